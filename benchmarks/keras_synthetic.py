"""Keras `model.fit` with BytePSStrategy on synthetic images: images/s of one
worker and of N workers on bandwidth-limited namespace hosts, the scaling
efficiency, and priority scheduling on vs off.

    sudo python benchmarks/keras_synthetic.py [--quick] [--model small_cnn|resnet50]

Runs, one after the other, each worker alone in a namespace host of its own
(servers on further hosts), every process with the same TF thread budget:

* single:      one worker, no cluster;
* independent: N single workers at once, not talking to each other -- the
               CPU contention of N workers on this machine, without any
               communication (the machine has far fewer cores than a real
               cluster has hosts);
* bps_tf:      N workers + S servers, priorities from the traced graph,
               BytePSStrategy(overlap=False) (a barrier between steps);
* bps_tf FIFO: the same with every gradient at one priority;
* with --overlap, also bps_tf overlap and bps_tf overlap FIFO: the same two
               under BytePSStrategy(overlap=True) (docs/overlap.md), and
               comm only: the same gradient set pushed and pulled every step
               with no compute (with `independent`, the two times overlap can
               at best hide behind each other); --timeline also records
               the first overlapped run's timeline and draws two of its
               steps (benchmarks/timeline_svg.py);
* with --unencrypted, also bps_tf CURVE off: bps_tf with BYTEPS_ENCRYPTION=0;
* with --fingerprint, also bps_tf fingerprint off and bps_tf fingerprint
               every step: bps_tf with BYTEPS_FINGERPRINT_STEPS=0 and =1 (the
               default, 100, checks once in 100 steps: its cost is the
               difference to "off" plus a hundredth of the every-step cost);
* with --overlap --blocking-check, also bps_tf overlap blocking check:
               bps_tf overlap with BYTEPS_EARLY_DATA_CHECK=0 (every step waits for
               tf.distribute's end-of-data sum across workers, as before
               bps_tf/strategy/data_check.py).

A run's step is its timed steps' wall time over their count (the throughput);
each worker also reports the CPU seconds it used per step and the share of
the machine's cores busy meanwhile, which says whether the step is bound by
the CPU (every process of every "host" shares this machine's cores) or by
waiting.

Scaling efficiency = images/s of the N-worker job / (N x images/s of one
worker). On a machine with fewer cores than workers that mixes communication
with CPU sharing, so the efficiency against the `independent` run (same CPU
sharing, no communication) is reported too, and against the independent
workers' steps combined as if synchronous (the slowest of the N at each
step): together they separate the communication from the CPU sharing and
from the straggler cost of synchronous training on a contended machine.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from statistics import fmean as mean

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.common import PYTHON, WORKERS_DIR, median  # noqa: E402
from benchmarks.netns_hosts import NetnsHosts, NetnsUnavailable  # noqa: E402

SCRIPT = str(WORKERS_DIR / "keras_fit.py")
# "fifo" is short for "bps_tf FIFO".
RUN_NAMES = ("single", "independent", "bps_tf", "fifo", "bps_tf FIFO", "bps_tf CURVE off",
             "bps_tf fingerprint off", "bps_tf fingerprint every step",
             "comm only", "bps_tf overlap", "bps_tf overlap FIFO",
             "bps_tf overlap blocking check")


def step_time(results) -> float:
    """Mean step of the slowest worker: the timed steps' wall time over their
    count, i.e. the job's throughput. Not a per-step statistic: under
    cross-step overlap a worker's step ends when its own forward and backward
    pass do, so the workers' step boundaries drift against each other by a
    fraction of a step while their totals stay equal (training is
    synchronous); a median of the per-step maximum counted that drift as
    time (0.248 s against a mean of 0.183-0.195 s for the small CNN)."""
    return max(mean(r["step_s"]) for r in results)


def as_if_synchronous(results) -> float:
    """Independent workers' steps combined as if they had been synchronous:
    the mean over steps of the slowest of the N at each step."""
    steps = min(len(r["step_s"]) for r in results)
    return mean(max(r["step_s"][k] for r in results) for k in range(steps))


def run_alone(spec, hosts, timeout):
    """len(hosts) workers, each alone (no cluster), started together."""
    with common.processes() as procs:
        spec = dict(spec, out_dir=str(procs.log_dir))
        path = common.write_spec(procs.log_dir, spec)
        children = [procs.start(f"alone{i}", [PYTHON, SCRIPT, str(path)],
                                common.child_env({"BENCH_RANK": str(i)}), h.prefix)
                    for i, h in enumerate(hosts)]
        procs.wait(children, timeout)
        return common.read_results(procs.log_dir, len(hosts))


def run_cluster(spec, worker_hosts, server_hosts, timeout, trace=None, env=None):
    """``trace``: (folder, first step, last step) to record the timeline of;
    ``env``: further variables for every process of the job."""
    env = dict(env or {})
    if trace:
        env.update({"BYTEPS_TRACE_ON": "1", "BYTEPS_TRACE_DIR": str(trace[0]),
                    "BYTEPS_TRACE_START_STEP": str(trace[1]),
                    "BYTEPS_TRACE_END_STEP": str(trace[2])})
    with common.processes() as procs:
        spec = dict(spec, out_dir=str(procs.log_dir))
        path = common.write_spec(procs.log_dir, spec)
        common.run_bps_job(procs, [PYTHON, SCRIPT, str(path)], num_workers=len(worker_hosts),
                           num_servers=len(server_hosts), worker_hosts=worker_hosts,
                           server_hosts=server_hosts, env=env, timeout=timeout)
        return common.read_results(procs.log_dir, len(worker_hosts))


def plot(rows, path: Path, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in rows if r["run"] != "comm only"]   # trains no images
    fig, ax = plt.subplots(figsize=(7, 3.8))
    names = [r["run"].replace(" ", "\n", 1) for r in rows]
    ax.bar(names, [r["images_per_s"] for r in rows],
           color=["C0", "C7", "C2", "C1", "C3", "C4", "C5", "C6"][:len(rows)])
    for i, r in enumerate(rows):
        ax.text(i, r["images_per_s"], f"{r['images_per_s']:.0f}", ha="center", va="bottom")
    ax.set_ylabel("images/s (all workers)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--rate", default="1gbit", help="tc rate of every host link ('none': no cap)")
    ap.add_argument("--model", default="small_cnn", choices=("small_cnn", "resnet50", "mlp",
                                                                "vgg_small", "frozen_backbone"),
                    help="frozen_backbone: vgg_small with its convolutions frozen "
                         "(fine-tuning a head)")
    ap.add_argument("--mlp-width", type=int, default=512,
                    help="--model mlp, vgg_small, frozen_backbone: units per dense layer")
    ap.add_argument("--mlp-depth", type=int, default=8, help="--model mlp: Dense layers")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--batch-per-worker", type=int, default=32)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="TF intra-op threads per worker")
    ap.add_argument("--rounds", type=int, default=2,
                    help="repeat every run this many times, interleaved; report medians")
    ap.add_argument("--quick", action="store_true", help="2 warm-up and 6 timed steps, 1 round")
    ap.add_argument("--skip", default="", help="comma-separated runs to leave out: "
                    + ",".join(RUN_NAMES))
    ap.add_argument("--overlap", action="store_true",
                    help="also run BytePSStrategy(overlap=True), with priorities and FIFO")
    ap.add_argument("--unencrypted", action="store_true",
                    help="also run bps_tf with BYTEPS_ENCRYPTION=0 (no CURVE between hosts, "
                         "as Horovod and BytePS send): what the encryption costs the step")
    ap.add_argument("--fingerprint", action="store_true",
                    help="also bps_tf with the replica fingerprint off and at every step")
    ap.add_argument("--blocking-check", action="store_true",
                    help="with --overlap: also run overlap with BYTEPS_EARLY_DATA_CHECK=0 "
                         "(every step waits for the cross-worker end-of-data sum)")
    ap.add_argument("--timeline", action="store_true",
                    help="with --overlap: record the first overlapped run's timeline and "
                         "draw two of its steps as an SVG next to the JSON")
    ap.add_argument("--host-nic", default="tbf", choices=("tbf", "paced"),
                    help="how each host's egress is modelled (benchmarks/netns_hosts.py): "
                         "tbf, a short drop-tail queue (earlier results); paced, TCP held "
                         "back in its socket as by a NIC at the link rate (no host drops)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out-dir")
    args = ap.parse_args(argv)
    if args.quick:
        args.warmup_steps, args.steps, args.rounds = 2, 6, 1
    # A run's step is a mean over its timed steps: none would only fail
    # after every run had been made.
    for flag, value, least in (("--steps", args.steps, 1), ("--rounds", args.rounds, 1),
                               ("--workers", args.workers, 1), ("--servers", args.servers, 1),
                               ("--warmup-steps", args.warmup_steps, 0)):
        if value < least:
            ap.error(f"{flag} must be at least {least}, not {value}")
    if args.blocking_check and not args.overlap:
        ap.error("--blocking-check adds an overlapped run: give --overlap too")
    skip = set(filter(None, args.skip.split(",")))
    if skip - set(RUN_NAMES):
        ap.error(f"--skip: no run named {', '.join(sorted(skip - set(RUN_NAMES)))}; "
                 f"the runs are {', '.join(RUN_NAMES)}")

    spec = {"model": args.model, "image_size": args.image_size,
            "batch_per_worker": args.batch_per_worker, "warmup_steps": args.warmup_steps,
            "steps": args.steps, "threads": args.threads, "priority": "on",
            "mlp_width": args.mlp_width, "mlp_depth": args.mlp_depth}
    n, batch = args.workers, args.batch_per_worker
    measured = {}   # run name -> [(step seconds, images/s, first step s, raw steps)] per round
    info = {}
    trace_dir = Path(args.out_dir or common.RESULTS_DIR) / "overlap_trace"
    traced_step = args.warmup_steps + 1
    traced = []
    try:
        with common.stop_on_signals(), NetnsHosts(n + args.servers,
                                                  host_nic=args.host_nic) as net:
            net.set_rate(None if args.rate in ("none", "unlimited") else args.rate)
            print(net.describe(), flush=True)
            workers, servers = net.hosts[:n], net.hosts[n:]
            plan = [("single", lambda: run_alone(spec, workers[:1], args.timeout)),
                    ("independent", lambda: run_alone(spec, workers, args.timeout)),
                    ("bps_tf", lambda: run_cluster(spec, workers, servers, args.timeout)),
                    ("bps_tf FIFO", lambda: run_cluster(dict(spec, priority="off"), workers,
                                                        servers, args.timeout))]
            if args.unencrypted:
                plan.append(("bps_tf CURVE off", lambda: run_cluster(
                    spec, workers, servers, args.timeout, env={"BYTEPS_ENCRYPTION": "0"})))
            if args.fingerprint:
                plan += [(f"bps_tf fingerprint {label}", lambda steps=steps: run_cluster(
                    spec, workers, servers, args.timeout,
                    env={"BYTEPS_FINGERPRINT_STEPS": steps}))
                    for label, steps in (("off", "0"), ("every step", "1"))]

            def overlapped():
                trace = None
                if args.timeline and not traced:
                    traced.append(trace_dir)
                    trace = (trace_dir, traced_step, traced_step + 1)
                return run_cluster(dict(spec, overlap=True), workers, servers, args.timeout,
                                   trace)

            if args.overlap:
                plan += [("comm only", lambda: run_cluster(dict(spec, comm_only=True), workers,
                                                           servers, args.timeout)),
                         ("bps_tf overlap", overlapped),
                         ("bps_tf overlap FIFO", lambda: run_cluster(
                             dict(spec, overlap=True, priority="off"), workers, servers,
                             args.timeout))]
                if args.blocking_check:
                    plan.append(("bps_tf overlap blocking check", lambda: run_cluster(
                        dict(spec, overlap=True), workers, servers, args.timeout,
                        env={"BYTEPS_EARLY_DATA_CHECK": "0"})))
            plan = [(name, run) for name, run in plan
                    if name not in skip and not (name == "bps_tf FIFO" and "fifo" in skip)]
            # Rounds interleave the runs, so a change in the machine's load
            # (it is shared) hits every run alike rather than one of them.
            for rnd in range(args.rounds):
                for name, run in plan:
                    print(f"[round {rnd + 1}/{args.rounds}] {name} ...", flush=True)
                    results = run()
                    info = {"params": results[0]["params"],
                            "gradients": results[0]["gradients"]}
                    if name in ("single", "independent"):
                        # Each alone: the throughput is the sum of the processes'.
                        t = mean(mean(r["step_s"]) for r in results)
                        ips = sum(batch / mean(r["step_s"]) for r in results)
                    else:
                        t = step_time(results)
                        ips = len(results) * batch / t
                    measured.setdefault(name, []).append(
                        (t, ips, max(r["first_step_s"] for r in results),
                         [r["step_s"] for r in results],
                         sum(r["cpu_s_per_step"] for r in results),
                         mean(r["machine_busy"] for r in results)))
    except NetnsUnavailable as exc:
        print(f"keras_synthetic: {exc}", file=sys.stderr)
        return 2

    rows = []
    for name, rounds in measured.items():
        rows.append({"run": name, "workers": 1 if name == "single" else n,
                     "step_s": median(r[0] for r in rounds),
                     "images_per_s": median(r[1] for r in rounds),
                     "first_step_s": median(r[2] for r in rounds),
                     "rounds_step_s": [r[0] for r in rounds],
                     "rounds_images_per_s": [r[1] for r in rounds],
                     "all_step_s": [r[3] for r in rounds],
                     # The workers' CPU seconds per step, summed (servers
                     # not counted), and the share of the machine's cores
                     # busy during the timed steps.
                     "workers_cpu_s_per_step": median(r[4] for r in rounds),
                     "machine_busy": median(r[5] for r in rounds)})
    by = {r["run"]: r for r in rows}
    summary = {}
    if "bps_tf" in by and "single" in by:
        summary["scaling_efficiency"] = by["bps_tf"]["images_per_s"] / (
            n * by["single"]["images_per_s"])
    if "bps_tf" in by and "independent" in by:
        summary["efficiency_vs_independent"] = (by["bps_tf"]["images_per_s"] /
                                                by["independent"]["images_per_s"])
    for run, key in (("bps_tf overlap", "efficiency_vs_independent_overlap"),
                     ("bps_tf CURVE off", "efficiency_vs_independent_curve_off")):
        if run in by and "independent" in by:
            summary[key] = by[run]["images_per_s"] / by["independent"]["images_per_s"]
    if "bps_tf" in by and "independent" in by:
        # The independent workers' steps combined as if they had been
        # synchronous (the slowest of the N at each step): the straggler
        # cost any synchronous job pays on a contended machine, without
        # communication.
        sync = median(as_if_synchronous([{"step_s": s} for s in rnd])
                      for rnd in by["independent"]["all_step_s"])
        summary["independent_as_if_synchronous_step_s"] = sync
        summary["efficiency_vs_independent_synchronous"] = sync / by["bps_tf"]["step_s"]
    if "bps_tf" in by and "bps_tf fingerprint off" in by:
        off = by["bps_tf fingerprint off"]["step_s"]
        summary["fingerprint_default_cost"] = by["bps_tf"]["step_s"] / off - 1
        if "bps_tf fingerprint every step" in by:
            every = by["bps_tf fingerprint every step"]["step_s"] / off - 1
            summary["fingerprint_every_step_cost"] = every
            # The default checks once in BYTEPS_FINGERPRINT_STEPS (100) steps.
            summary["fingerprint_default_amortized_cost"] = every / 100
    if "bps_tf" in by and "bps_tf FIFO" in by:
        summary["priority_speedup"] = by["bps_tf FIFO"]["step_s"] / by["bps_tf"]["step_s"]
    if "bps_tf" in by and "bps_tf overlap" in by:
        summary["overlap_speedup"] = by["bps_tf"]["step_s"] / by["bps_tf overlap"]["step_s"]
    if "bps_tf overlap" in by and "comm only" in by and "independent" in by:
        bound = max(by["comm only"]["step_s"], by["independent"]["step_s"])
        summary["overlap_over_max_compute_comm"] = by["bps_tf overlap"]["step_s"] / bound
        summary["comm_over_compute"] = by["comm only"]["step_s"] / by["independent"]["step_s"]
        # Where every process shares this machine's cores, compute and
        # communication can only hide behind each other while their CPU
        # work fits on the cores together: the step is at least their
        # core-seconds over the core count, i.e. the sum of each one's step
        # times the share of the cores it kept busy.
        summary["cpu_bound_step_s"] = sum(by[name]["step_s"] * by[name]["machine_busy"]
                                          for name in ("independent", "comm only"))
        summary["overlap_over_cpu_bound"] = (by["bps_tf overlap"]["step_s"] /
                                             summary["cpu_bound_step_s"])
    # How much slower each variant of the default overlapped run was.
    for run, key in (("bps_tf overlap blocking check", "early_check_speedup"),
                     ("bps_tf overlap FIFO", "overlap_priority_speedup")):
        if "bps_tf overlap" in by and run in by:
            summary[key] = by[run]["step_s"] / by["bps_tf overlap"]["step_s"]
    title = (f"{args.model} {args.image_size}x{args.image_size}, {batch}/worker, {n} workers + "
             f"{args.servers} servers, {args.rate} links, {args.threads} thread(s)/worker")
    common.print_table(title + f" (median of {args.rounds} round(s))",
                       ["run", "workers", "step s", "images/s", "first step s",
                        "step s per round", "workers' CPU s/step", "cores busy"],
                       [[r["run"], r["workers"], r["step_s"], r["images_per_s"],
                         r["first_step_s"], " ".join(f"{t:.3f}" for t in r["rounds_step_s"]),
                         r["workers_cpu_s_per_step"], f"{r['machine_busy']:.0%}"]
                        for r in rows])
    for key, value in summary.items():
        print(f"  {key}: {value:.3f}")
    out = common.write_json("keras_synthetic", {
        "config": vars(args), "model_info": info, "rows": rows, "summary": summary,
        "targets": {"scaling_efficiency": ">= 0.90",
                    "overlap_over_max_compute_comm": "<= 1.15",
                    "overlap_speedup": ">= 1.3 where comm_over_compute is about 1"}}, args.out_dir)
    plot(rows, out.with_suffix(".png"), title)
    if traced:
        from benchmarks import timeline_svg
        timeline_svg.draw(trace_dir / "bps_trace_rank0.json", traced_step,
                          out.with_name(out.stem + "_timeline.svg"),
                          f"{args.model}, {n} workers, {args.rate}: rank 0")
    return 0


if __name__ == "__main__":
    common.run_main(main)
