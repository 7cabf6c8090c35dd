"""bps_tf on bandwidth-limited hosts: 4 workers + 4 servers, each in its own
network namespace with a tc-capped link, against TensorFlow's ring
all-reduce on the same worker hosts, for a ResNet-50 gradient set.

    sudo python benchmarks/netns_cluster.py [--rate 1gbit,5gbit] [--quick]

Why this setting: on one host every byte crosses the same memory, so ring
all-reduce (half the bytes of a push/pull) wins on loopback. With a link per
host, a worker's link carries M bytes each way with push/pull and
2(n-1)/n * M with a ring, so the lower bound per step is M/B for bps_tf and
1.5 M/B for a 4-worker ring (B = link rate, M = gradient bytes).

Per rate, measured in this run on the same hosts:
* bps_tf: the 214 ResNet-50 gradients (25.6 M float32, ~102 MB) push_pulled
  at once per step by numpy workers, priorities in forward order;
* tcp-echo: the raw-TCP ceiling of the same data movement on these links
  (each worker host sends M split over the server hosts and gets it back;
  the C++ tool benchmarks/echo/ps_echo.cc, or --echo python);
* TF ring: MultiWorkerMirroredStrategy (RING) all-reducing the same 214
  tensors from a tf.function, one process per worker host.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, cxx_echo, link_usage  # noqa: E402
from benchmarks.common import PYTHON, WORKERS_DIR, median  # noqa: E402
from benchmarks.netns_hosts import NetnsHosts, NetnsUnavailable  # noqa: E402
from benchmarks.resnet50_shapes import count_values, resnet50_trainable_shapes  # noqa: E402


def resnet50_case(warmup: int, reps: int) -> dict:
    shapes = resnet50_trainable_shapes()
    # The forward pass reads the first variable first: highest priority, as
    # BytePSStrategy's rewriter assigns them (0, -1, -2, ...).
    tensors = [[name, list(shape), -i] for i, (name, shape) in enumerate(shapes)]
    return {"label": "resnet50", "warmup": warmup, "reps": reps, "tensors": tensors,
            "bytes": 4 * count_values(shapes)}


def step_times(results) -> list:
    per_worker = [r["cases"][0] for r in results]
    if not all(c.get("correct", True) for c in per_worker):
        raise common.JobFailed("wrong sums")
    return common.rep_durations(per_worker)


def run_bps(net, case, workers, servers, script="bps_numpy.py", env=None, monitor=None):
    """Step times; with ``monitor`` (a path), also samples every host's link
    during the job and writes the samples and the step intervals there."""
    with common.processes() as procs:
        spec = common.write_spec(procs.log_dir, {"out_dir": str(procs.log_dir), "cases": [case]})
        sampler = None
        if monitor:
            sampler = procs.start("link_monitor", [PYTHON, str(WORKERS_DIR / "link_monitor.py"),
                                                   str(monitor)] + net.ports,
                                  common.child_env(), net.switch_prefix, must_succeed=False)
        common.run_bps_job(procs, [PYTHON, str(WORKERS_DIR / script), str(spec)],
                           num_workers=workers, num_servers=servers,
                           worker_hosts=net.hosts[:workers],
                           server_hosts=net.hosts[workers:workers + servers], env=env,
                           timeout=3600)
        results = common.read_results(procs.log_dir, workers)
        if sampler:
            sampler.popen.terminate()
            sampler.popen.wait(30)
            data = json.loads(Path(monitor).read_text())
            per_worker = [r["cases"][0] for r in results]
            data["steps"] = [[max(r["starts"][k] for r in per_worker),
                              max(r["ends"][k] for r in per_worker)]
                             for k in range(len(per_worker[0]["ends"]))]
            data["hosts"] = [f"worker{i}" for i in range(workers)] + \
                [f"server{i}" for i in range(servers)]
            Path(monitor).write_text(json.dumps(data))
        return step_times(results)


def run_echo(net, case, workers, servers, impl="cxx"):
    echo_case = {k: case[k] for k in ("label", "warmup", "reps", "bytes")}
    run = cxx_echo.run_job if impl == "cxx" else common.run_echo_job
    with common.processes() as procs:
        results = run(procs, [echo_case], num_clients=workers,
                                      num_servers=servers, client_hosts=net.hosts[:workers],
                                      server_hosts=net.hosts[workers:workers + servers],
                                      timeout=3600)
    return common.rep_durations([r["cases"][0] for r in results])


def run_tf(net, case, workers):
    with common.processes() as procs:
        spec = common.write_spec(procs.log_dir, {"out_dir": str(procs.log_dir), "cases": [case]})
        common.run_tf_job(procs, [PYTHON, str(WORKERS_DIR / "tf_allreduce.py"), str(spec)],
                          num_workers=workers, hosts=net.hosts[:workers], timeout=3600)
        return step_times(common.read_results(procs.log_dir, workers))


def monitor_path(args, rate: str, name: str, unlimited: bool):
    """Where --monitor keeps the link samples of one bps_tf run (None: off)."""
    if not args.monitor or unlimited:
        return None
    out_dir = Path(args.out_dir) if args.out_dir else common.RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = name.replace("bps_tf", "").strip().replace(" ", "")
    return out_dir / f"netns_links_{rate}{'_' + suffix if suffix else ''}.json"


def plot(rows, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    order = ["bound M/B", "tcp-echo", "bps_tf", "bps_tf part", "bps_tf TF op",
             "ring bound 1.5M/B", "TF ring"]
    present = {k for r in rows for k in r["seconds"]}
    names = sorted(present, key=lambda k: next(i for i, o in enumerate(order)
                                               if k.startswith(o)))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        xs = [i + j * width for i in range(len(rows))]
        ax.bar(xs, [r["seconds"].get(name, 0) for r in rows], width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [r["rate"] for r in rows])
    ax.set_ylabel("seconds per step (lower is better)")
    ax.set_title("ResNet-50 gradients, 4 workers (+4 servers), tc-limited hosts")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit",
                    help="comma-separated tc rates per host link ('none': no cap, to see "
                         "what the CPUs alone allow)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="1 warm-up and 3 steps")
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--no-tf", action="store_true", help="skip TensorFlow's ring all-reduce")
    ap.add_argument("--no-echo", action="store_true", help="skip the raw-TCP ceiling")
    ap.add_argument("--echo", choices=("cxx", "python"), default="cxx",
                    help="which raw-TCP echo is the ceiling (C++ tool or the Python one)")
    ap.add_argument("--tf-op", action="store_true", help="also time bps_tf through the TF op")
    ap.add_argument("--flat-priority", action="store_true",
                    help="every gradient at priority 0 (FIFO in enqueue order)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="extra setting for the bps_tf processes (e.g. BYTEPS_PARTITION_BYTES)")
    ap.add_argument("--monitor", action="store_true",
                    help="sample every link during the bps_tf run (netns_links_<rate>.json/png)")
    ap.add_argument("--partition-bytes", default="",
                    help="comma-separated BYTEPS_PARTITION_BYTES values to compare (the first "
                         "is the 'bps_tf' column; default: the engine's default)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat every run this many times, interleaved; report medians")
    ap.add_argument("--host-nic", default="tbf", choices=("tbf", "paced"),
                    help="how each host's egress is modelled (benchmarks/netns_hosts.py): tbf, a "
                         "short drop-tail queue (earlier results); paced, TCP held back in its "
                         "socket as by a NIC at the link rate (no host drops)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--out-dir")
    args = ap.parse_args(argv)
    partitions = [common.parse_size(p) for p in args.partition_bytes.split(",") if p] or [None]
    bps_env = dict(item.split("=", 1) for item in args.env)
    if args.quick:
        args.warmup, args.reps = 1, 3

    case = resnet50_case(args.warmup, args.reps)
    if args.flat_priority:
        for t in case["tensors"]:
            t[2] = 0
    m = case["bytes"]
    n = args.workers
    rows = []
    try:
        with common.stop_on_signals(), NetnsHosts(args.workers + args.servers,
                                                  mtu=args.mtu, host_nic=args.host_nic) as net:
            for rate in args.rate.split(","):
                unlimited = rate in ("none", "unlimited")
                net.set_rate(None if unlimited else rate)
                print(f"\n{net.describe()}", flush=True)
                b = float("inf") if unlimited else common.parse_rate(rate)
                plan = []
                if not args.no_echo:
                    plan.append(("tcp-echo", lambda: run_echo(net, case, args.workers,
                                                              args.servers, args.echo)))
                for pb in partitions:
                    env = dict(bps_env, **({"BYTEPS_PARTITION_BYTES": str(pb)} if pb else {}))
                    name = "bps_tf" if pb == partitions[0] else f"bps_tf part {pb}"
                    plan.append((name, lambda env=env, name=name: run_bps(
                        net, case, args.workers, args.servers, env=env,
                        monitor=monitor_path(args, rate, name, unlimited))))
                if args.tf_op:
                    plan.append(("bps_tf TF op", lambda: run_bps(
                        net, case, args.workers, args.servers, "bps_tf_op.py",
                        env=dict(bps_env, **({"BYTEPS_PARTITION_BYTES": str(partitions[0])}
                                             if partitions[0] else {})),
                        monitor=monitor_path(args, rate, "bps_tf TF op", unlimited))))
                if not args.no_tf:
                    plan.append(("TF ring", lambda: run_tf(net, case, args.workers)))
                runs = {}
                # Rounds interleave the runs against drifts in the shared machine's load.
                for rnd in range(args.rounds):
                    for name, run in plan:
                        print(f"[round {rnd + 1}/{args.rounds}] {name} ...", flush=True)
                        runs.setdefault(name, []).append(run())
                seconds = {name: median(median(t) for t in per_round)
                           for name, per_round in runs.items()}
                seconds["bound M/B"] = m / b
                seconds["ring bound 1.5M/B"] = 2 * (n - 1) / n * m / b
                row = {"rate": rate, "bytes_per_s": b, "gradient_bytes": m,
                       "seconds": seconds, "all_steps": runs,
                       "fraction_of_bound": {k: seconds["bound M/B"] / v
                                             for k, v in seconds.items() if "bound" not in k},
                       "bps_fraction_of_bound": seconds["bound M/B"] / seconds["bps_tf"]}
                if "tcp-echo" in seconds:
                    row["tcp_echo_fraction_of_bound"] = seconds["bound M/B"] / seconds["tcp-echo"]
                if "TF ring" in seconds:
                    row["speedup_over_tf_ring"] = seconds["TF ring"] / seconds["bps_tf"]
                if args.monitor and not unlimited:
                    row["link_use"] = {}
                    for name in (r for r in runs if r.startswith("bps_tf")):
                        print(f"\n{name}:")
                        row["link_use"][name] = link_usage.report(
                            monitor_path(args, rate, name, False), rate)
                rows.append(row)
    except NetnsUnavailable as exc:
        print(f"netns_cluster: {exc}", file=sys.stderr)
        return 2

    names = [k for k in rows[0]["seconds"]]
    common.print_table(
        f"ResNet-50 gradient set ({len(case['tensors'])} tensors, {m / 1e6:.1f} MB) per step, "
        f"{args.workers} workers + {args.servers} servers, one namespace each",
        ["rate"] + [f"{k} s" for k in names] + ["bps/bound", "echo/bound", "bps vs TF"],
        [[r["rate"]] + [r["seconds"][k] for k in names] +
         [r["bps_fraction_of_bound"], r.get("tcp_echo_fraction_of_bound", float("nan")),
          r.get("speedup_over_tf_ring", float("nan"))] for r in rows])
    measured = [k for k in names if "bound" not in k]
    common.print_table("fraction of the bound M/B (1.0 = every worker link busy all the time)",
                       ["rate"] + measured,
                       [[r["rate"]] + [r["fraction_of_bound"][k] for k in measured]
                        for r in rows])
    out = common.write_json("netns_cluster", {
        "workers": args.workers, "servers": args.servers, "mtu": args.mtu,
        "bps_env": bps_env, "flat_priority": args.flat_priority, "rounds": args.rounds,
        "partition_bytes": partitions,
        "tensors": len(case["tensors"]), "rows": rows,
        "targets": {"bps/bound": ">= 0.90", "bps vs TF ring": ">= 1.4"}}, args.out_dir)
    if not args.no_plot:
        plot(rows, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    common.run_main(main)
