"""Local reduce on bandwidth-limited hosts: 2 worker hosts with 2 worker
processes each, 2 server hosts, every host its own network namespace with a
tc-capped link; the ResNet-50 gradient set (M = 102 MB) per step.

    sudo python benchmarks/local_reduce_netns.py [--rate 1gbit] [--rounds 2]

Interleaved runs with BYTEPS_LOCAL_REDUCE=1 and =0 on the same hosts. The
link monitor counts the bytes each worker host's link carried during the
timed steps: with local reduce a host uploads and downloads M per step, one
push and one pull of its sum; without it, 2M (each process its own).
Needs root (namespaces, tc) and an in-place build (`python setup.py
build_ext --inplace`), like the other namespace benchmarks.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.common import PYTHON, WORKERS_DIR, median  # noqa: E402
from benchmarks.netns_cluster import resnet50_case, step_times  # noqa: E402
from benchmarks.netns_hosts import NetnsHosts, NetnsUnavailable  # noqa: E402

WORKERS_PER_HOST = 2


def link_bytes(data, starts_ends, ports):
    """Bytes per timed step each worker host's link carried: (up, down)."""
    rows = data["samples"]

    def counter(t, col):
        best = rows[0]
        for row in rows:
            if row[0] > t:
                break
            best = row
        return best[col]

    t0, t1 = starts_ends[0][0], starts_ends[-1][1]
    steps = len(starts_ends)
    out = []
    for i in range(ports):
        down = counter(t1, 1 + 2 * i) - counter(t0, 1 + 2 * i)
        up = counter(t1, 2 + 2 * i) - counter(t0, 2 + 2 * i)
        out.append((up / steps, down / steps))
    return out


def run(net, case, local_reduce: str):
    workers = 2 * WORKERS_PER_HOST
    hosts = [net.hosts[0]] * WORKERS_PER_HOST + [net.hosts[1]] * WORKERS_PER_HOST
    with common.processes() as procs:
        spec = common.write_spec(procs.log_dir, {"out_dir": str(procs.log_dir), "cases": [case]})
        monitor = procs.log_dir / "links.json"
        sampler = procs.start("link_monitor", [PYTHON, str(WORKERS_DIR / "link_monitor.py"),
                                               str(monitor)] + net.ports[:2],
                              common.child_env(), net.switch_prefix, must_succeed=False)
        common.run_bps_job(procs, [PYTHON, str(WORKERS_DIR / "bps_numpy.py"), str(spec)],
                           num_workers=workers, num_servers=2, worker_hosts=hosts,
                           server_hosts=net.hosts[2:4],
                           env={"BYTEPS_LOCAL_REDUCE": local_reduce}, timeout=900)
        results = common.read_results(procs.log_dir, workers)
        sampler.popen.terminate()
        sampler.popen.wait(30)
        per_worker = [r["cases"][0] for r in results]
        steps = [[max(r["starts"][k] for r in per_worker), max(r["ends"][k] for r in per_worker)]
                 for k in range(len(per_worker[0]["ends"]))]
        sent = [r["stats"]["partitions_sent"] for r in results]
        return step_times(results), link_bytes(json.loads(monitor.read_text()), steps, 2), sent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved on/off pairs")
    ap.add_argument("--out-dir")
    args = ap.parse_args(argv)
    case = resnet50_case(args.warmup, args.reps)
    m = case["bytes"]
    rows = {"1": [], "0": []}
    try:
        with common.stop_on_signals(), NetnsHosts(4, rate=args.rate) as net:
            print(net.describe(), flush=True)
            for _ in range(args.rounds):
                for lr in ("1", "0"):
                    times, links, sent = run(net, case, lr)
                    rows[lr].append({"step_s": times, "links": links, "partitions_sent": sent})
                    print(f"BYTEPS_LOCAL_REDUCE={lr}: step {median(times):.3f} s, per host link "
                          + ", ".join(f"up {u / m:.2f} M down {d / m:.2f} M" for u, d in links)
                          + f"; partitions sent per worker {sent}", flush=True)
    except NetnsUnavailable as exc:
        print(f"skipped: {exc}", file=sys.stderr)
        return 2
    b = common.parse_rate(args.rate)
    summary = {"rate": args.rate, "M_bytes": m, "M_over_B_s": m / b, "runs": rows}
    print(f"\nM = {m / 1e6:.1f} MB, M/B = {m / b:.3f} s at {args.rate}")
    for lr, label in (("1", "local reduce on"), ("0", "local reduce off")):
        steps = [median(r["step_s"]) for r in rows[lr]]
        ups = [u / m for r in rows[lr] for u, _ in r["links"]]
        downs = [d / m for r in rows[lr] for _, d in r["links"]]
        print(f"{label:17s} step median {median(steps):.3f} s (runs {', '.join(f'{s:.3f}' for s in steps)}), "
              f"per host link up {min(ups):.2f}-{max(ups):.2f} M, down {min(downs):.2f}-{max(downs):.2f} M")
    common.write_json("local_reduce_netns", summary, args.out_dir)
    return 0


if __name__ == "__main__":
    common.run_main(main)
