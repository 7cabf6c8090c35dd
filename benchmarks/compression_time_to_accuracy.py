"""Time to accuracy with gradient compression on bandwidth-limited hosts:
`model.fit` under BytePSStrategy(compression=...), 4 workers and 4 servers,
each in its own network namespace with a tc-capped link.

    sudo python benchmarks/compression_time_to_accuracy.py [--rate 100mbit] [--quick]

The model is an MLP (default 256-512-512-10, 0.4 M parameters, 1.6 MB of
gradients a step) on a learnable synthetic task (labels from a fixed linear
teacher); plain SGD, the same seed and data for every compressor. The
uncompressed run trains --steps steps; the compressed ones up to
--steps-factor times as many, so that they can reach its final accuracy.
Every worker evaluates on the same held-out set every --eval-every steps;
the training time so far (evaluation excluded) is recorded with it.

Reported per compressor: the accuracy at the end, the training time to
reach the uncompressed run's final accuracy minus --tolerance (the first
evaluation at or above it), the speed-up over the uncompressed run, and the
bytes each worker sent and received per step (the engine's counters,
headers and metrics included).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.common import PYTHON, WORKERS_DIR  # noqa: E402
from benchmarks.netns_hosts import NetnsHosts, NetnsUnavailable  # noqa: E402

SCRIPT = str(WORKERS_DIR / "compression_fit.py")
COMPRESSORS = ("none", "fp16", "onebit+ef", "topk1%+ef", "randomk10%+ef", "dithering8")


def run(spec, worker_hosts, server_hosts, timeout, env):
    with common.processes() as procs:
        spec = dict(spec, out_dir=str(procs.log_dir))
        path = common.write_spec(procs.log_dir, spec)
        common.run_bps_job(procs, [PYTHON, SCRIPT, str(path)], num_workers=len(worker_hosts),
                           num_servers=len(server_hosts), worker_hosts=worker_hosts,
                           server_hosts=server_hosts, env=env, timeout=timeout)
        return common.read_results(procs.log_dir, len(worker_hosts))


def time_to(curve, target):
    """Training seconds at the first evaluation reaching ``target`` (None: never)."""
    for _step, seconds, acc in curve:
        if acc >= target:
            return seconds
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="100mbit", help="tc rate of every host link")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--compressors", default=",".join(COMPRESSORS))
    ap.add_argument("--steps", type=int, default=320)
    ap.add_argument("--steps-factor", type=float, default=2.0)
    ap.add_argument("--partition-bytes", type=int, default=262144,
                    help="BYTEPS_PARTITION_BYTES: spreads each kernel over the servers")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--batch-per-worker", type=int, default=64)
    ap.add_argument("--hidden", default="512,512")
    ap.add_argument("--lr", type=float, default=0.3)
    ap.add_argument("--tolerance", type=float, default=0.005)
    ap.add_argument("--threads", type=int, default=1, help="TF intra-op threads per worker")
    ap.add_argument("--quick", action="store_true", help="64 steps")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out-dir")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps = 64
    names = [c for c in args.compressors.split(",") if c]
    unknown = sorted(set(names) - set(COMPRESSORS))
    if unknown or "none" not in names:
        ap.error(f"--compressors: need 'none' and names from {', '.join(COMPRESSORS)}; "
                 f"unknown: {unknown}")
    spec = {"steps": args.steps, "eval_every": args.eval_every,
            "batch_per_worker": args.batch_per_worker, "features": 256, "classes": 10,
            "hidden": [int(h) for h in args.hidden.split(",")], "lr": args.lr,
            "threads": args.threads}
    env = {"BYTEPS_PARTITION_BYTES": str(args.partition_bytes)}
    runs = {}
    try:
        with common.stop_on_signals(), NetnsHosts(args.workers + args.servers) as net:
            net.set_rate(args.rate)
            print(net.describe(), flush=True)
            workers, servers = net.hosts[:args.workers], net.hosts[args.workers:]
            for name in names:
                print(f"{name} ...", flush=True)
                steps = args.steps if name == "none" else int(args.steps * args.steps_factor)
                runs[name] = run(dict(spec, compression=name, steps=steps), workers, servers,
                                 args.timeout, env)
    except NetnsUnavailable as exc:
        print(f"cannot build the namespace hosts: {exc}", file=sys.stderr)
        return 2

    # Training is synchronous: a step ends for everyone with the slowest worker.
    curves = {name: [[s, max(r["curve"][i][1] for r in rs), rs[0]["curve"][i][2]]
                     for i, (s, _t, _a) in enumerate(rs[0]["curve"])]
              for name, rs in runs.items()}
    target = curves["none"][-1][2] - args.tolerance
    base = time_to(curves["none"], target)
    rows = []
    for name, rs in runs.items():
        t = time_to(curves[name], target)
        sent = sum(r["bytes_sent_per_step"] for r in rs) / len(rs)
        received = sum(r["bytes_received_per_step"] for r in rs) / len(rs)
        rows.append({"compression": name, "steps": rs[0]["steps"],
                     "final_accuracy": curves[name][-1][2],
                     "train_s": curves[name][-1][1], "time_to_target_s": t,
                     "speedup": base / t if t else None,
                     "sent_per_step": sent, "received_per_step": received})
    common.print_table(
        f"{args.workers} workers x {args.servers} servers at {args.rate}, none: {args.steps} "
        f"steps, the others up to {int(args.steps * args.steps_factor)}; "
        f"target accuracy {target:.4f} (none's final - {args.tolerance})",
        ["compression", "final acc", "train s", "to target s", "speed-up", "sent B/step",
         "received B/step"],
        [[r["compression"], r["final_accuracy"], r["train_s"],
          "never" if r["time_to_target_s"] is None else r["time_to_target_s"],
          "-" if r["speedup"] is None else round(r["speedup"], 2),
          int(r["sent_per_step"]), int(r["received_per_step"])] for r in rows])
    common.write_json("compression_time_to_accuracy",
                      {"args": vars(args), "params": runs["none"][0]["params"],
                       "target": target, "rows": rows, "curves": curves}, args.out_dir)
    return 0


if __name__ == "__main__":
    common.run_main(main)
