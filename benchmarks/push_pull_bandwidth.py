"""Push_pull bus bandwidth on loopback: bps_tf against the raw-TCP bound of the
same data movement and against TensorFlow's collective all-reduce.

    python benchmarks/push_pull_bandwidth.py [--quick] [--sizes 4KiB,64MiB] [--tf-op]
        [--encryption on|off|both|curve|all]

Per tensor size, all measured in this run, one after the other:

* tcp-echo: the raw-TCP bound. Each of W client processes sends its M bytes
  split over S echo-server processes and receives them back, all at once --
  what a bps_tf worker does against S servers, minus the summing. The C++
  tool benchmarks/echo/ps_echo.cc by default; --echo python for the older
  Python echo (workers/tcp_echo.py), which bps_tf outruns at small sizes;
* unix-echo: the same over abstract Unix sockets (the C++ tool only): the
  bound of bps_tf's links on one machine, which use Unix sockets by default
  (BYTEPS_ENABLE_IPC; --ipc off makes them TCP and drops this column). The
  "bound" ratios use this one when it is there;
* bps_tf (numpy): W workers x S servers, one push_pull of an M-byte float32
  tensor per repetition (no TensorFlow in the process: fast start-up);
* bps_tf (TF op): the same through `push_pull_sum` in a tf.function (--tf-op);
* TF ring: MultiWorkerMirroredStrategy, CommunicationImplementation.RING, W
  processes, all-reduce of the same tensor.

bps_tf jobs run with a job token, so their connections are encrypted (sealed
links, BYTEPS_ENCRYPTION=1, the default) unless --encryption off;
--encryption curve runs them with ZeroMQ CURVE instead (BYTEPS_ENCRYPTION=curve).
--encryption both adds the numpy column with BYTEPS_ENCRYPTION=0, in the same
rounds, to measure what encryption costs; --encryption all adds that column and
a CURVE numpy column (the main numpy column is then sealed).

Bus bandwidth per worker = (bytes pushed + bytes pulled) / time = 2M / t, the
same formula for every column, so the ratios are ratios of times. Time = the
median over repetitions after warm-up, a repetition lasting from the last
worker's start to the last worker's end.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, cxx_echo  # noqa: E402
from benchmarks.common import PYTHON, WORKERS_DIR, fmt_size, median  # noqa: E402

DEFAULT_SIZES = "4KiB,64KiB,1MiB,4MiB,16MiB,64MiB,256MiB"
UNENCRYPTED = "bps_tf numpy no-enc"
CURVE = "bps_tf numpy curve"
QUICK_SIZES = "4KiB,1MiB,16MiB,64MiB"


def repetitions(size: int, quick: bool) -> int:
    # Enough repetitions for a stable median at small sizes, few at large
    # ones where one repetition already takes a second.
    if quick:
        return max(3, min(20, (256 << 20) // max(size, 1)))
    return max(4, min(50, (512 << 20) // max(size, 1)))


def make_cases(sizes, quick: bool, warmup: int):
    return [{"label": fmt_size(s).replace(" ", ""), "bytes": s, "warmup": warmup,
             "reps": repetitions(s, quick),
             "tensors": [["t", [max(1, s // 4)], 0]]} for s in sizes]


def case_times(results, count):
    """{label: median seconds} from the per-worker result files."""
    out = {}
    for i, case in enumerate(results[0]["cases"]):
        per_worker = [r["cases"][i] for r in results]
        if not all(c.get("correct", True) for c in per_worker):
            raise common.JobFailed(f"wrong sums in case {case['label']}")
        out[case["label"]] = median(common.rep_durations(per_worker))
    assert len(out) == count
    return out


def run_echo(cases, workers, servers, impl="cxx", unix=False):
    with common.processes() as procs:
        if impl == "cxx":
            results = cxx_echo.run_job(procs, cases, num_clients=workers, num_servers=servers,
                                       unix=unix)
        else:
            results = common.run_echo_job(procs, cases, num_clients=workers, num_servers=servers)
    return case_times(results, len(cases))


def run_bps(cases, workers, servers, script: str, env=None):
    with common.processes() as procs:
        spec = common.write_spec(procs.log_dir, {"out_dir": str(procs.log_dir), "cases": cases})
        common.run_bps_job(procs, [PYTHON, str(WORKERS_DIR / script), str(spec)],
                           num_workers=workers, num_servers=servers, timeout=1800, env=env)
        return case_times(common.read_results(procs.log_dir, workers), len(cases))


def run_tf(cases, workers, api="all_reduce"):
    with common.processes() as procs:
        spec = common.write_spec(procs.log_dir, {"out_dir": str(procs.log_dir), "cases": cases,
                                                 "tf_api": api})
        common.run_tf_job(procs, [PYTHON, str(WORKERS_DIR / "tf_allreduce.py"), str(spec)],
                          num_workers=workers, timeout=1800)
        return case_times(common.read_results(procs.log_dir, workers), len(cases))


def plot(rows, columns, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    sizes = [r["bytes"] for r in rows]
    for col in columns:
        ax.plot(sizes, [r["bus_GBps"].get(col, float("nan")) for r in rows], marker="o", label=col)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [r["label"] for r in rows], rotation=30)
    ax.set_xlabel("tensor size")
    ax.set_ylabel("bus bandwidth per worker (GB/s)")
    ax.set_title("push_pull on loopback, 2 workers x 2 servers")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", help=f"comma-separated sizes (default {DEFAULT_SIZES})")
    ap.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, fewer repetitions")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every column this many times, interleaved; report the median")
    ap.add_argument("--tf-op", action="store_true", help="also time the TensorFlow op")
    ap.add_argument("--no-tf", action="store_true", help="skip the TensorFlow all-reduce")
    ap.add_argument("--tf-api", choices=("all_reduce", "reduce_to"), default="all_reduce",
                    help="replica-context all_reduce (what Keras calls) or "
                         "strategy.extended.reduce_to per tensor")
    ap.add_argument("--fresh-output", action="store_true",
                    help="also time numpy workers that allocate a new output every repetition "
                         "(what TensorFlow does), to separate page-fault cost from the engine")
    ap.add_argument("--encryption", choices=("on", "off", "both", "curve", "all"), default="on",
                    help="BYTEPS_ENCRYPTION of the bps_tf jobs (on: sealed links, the default; "
                         "curve: ZeroMQ CURVE); both: an extra numpy column without encryption, "
                         "interleaved with the others; all: that column and a CURVE one")
    ap.add_argument("--echo", choices=("cxx", "python"), default="cxx",
                    help="which raw-TCP echo is the bound (C++ tool or the Python one)")
    ap.add_argument("--ipc", choices=("on", "off"), default="on",
                    help="BYTEPS_ENABLE_IPC of the bps_tf jobs (on, the default: Unix sockets "
                         "between workers and servers, with the Unix-socket echo as the bound)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--out-dir", help="where the JSON and PNG go (default benchmarks/results)")
    args = ap.parse_args(argv)

    sizes = common.parse_sizes(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))
    cases = make_cases(sizes, args.quick, args.warmup)
    ipc = {"BYTEPS_ENABLE_IPC": "1" if args.ipc == "on" else "0"}
    enc = dict(ipc, BYTEPS_ENCRYPTION={"off": "0", "curve": "curve"}.get(args.encryption, "1"))
    runners = {"tcp-echo bound": lambda: run_echo(cases, args.workers, args.servers, args.echo)}
    bound = "tcp-echo bound"
    if args.ipc == "on" and args.echo == "cxx":
        bound = "unix-echo bound"
        runners[bound] = lambda: run_echo(cases, args.workers, args.servers, "cxx", unix=True)
    runners["bps_tf numpy"] = lambda: run_bps(cases, args.workers, args.servers,
                                              "bps_numpy.py", enc)
    if args.encryption == "all":
        runners[CURVE] = lambda: run_bps(cases, args.workers, args.servers,
                                         "bps_numpy.py", dict(ipc, BYTEPS_ENCRYPTION="curve"))
    if args.encryption in ("both", "all"):
        runners[UNENCRYPTED] = lambda: run_bps(cases, args.workers, args.servers,
                                               "bps_numpy.py", dict(ipc, BYTEPS_ENCRYPTION="0"))
    if args.fresh_output:
        fresh_cases = [dict(c, fresh_output=True) for c in cases]
        runners["bps_tf numpy fresh out"] = lambda: run_bps(fresh_cases, args.workers,
                                                            args.servers, "bps_numpy.py", enc)
    if args.tf_op:
        runners["bps_tf TF op"] = lambda: run_bps(cases, args.workers, args.servers,
                                                  "bps_tf_op.py", enc)
    if not args.no_tf:
        runners["TF ring"] = lambda: run_tf(cases, args.workers, args.tf_api)

    times = {name: {c["label"]: [] for c in cases} for name in runners}
    with common.stop_on_signals():
        for rnd in range(args.rounds):
            for name, run in runners.items():
                print(f"[round {rnd + 1}/{args.rounds}] {name} ...", flush=True)
                for label, t in run().items():
                    times[name][label].append(t)

    rows = []
    for c in cases:
        t = {name: median(times[name][c["label"]]) for name in runners}
        row = {"label": c["label"], "bytes": c["bytes"], "reps": c["reps"], "seconds": t,
               "bus_GBps": {n: 2 * c["bytes"] / v / 1e9 for n, v in t.items()},
               "all_rounds_seconds": {n: times[n][c["label"]] for n in runners}}
        bps = t["bps_tf numpy"]
        row["bps_over_tcp_bound"] = t["tcp-echo bound"] / bps
        row["bps_over_bound"] = t[bound] / bps
        if UNENCRYPTED in t:
            # time with encryption / time without, per round then the median
            pairs = zip(times["bps_tf numpy"][c["label"]], times[UNENCRYPTED][c["label"]])
            row["encrypted_over_unencrypted_time"] = median([a / b for a, b in pairs])
        if CURVE in t and UNENCRYPTED in t:
            pairs = zip(times[CURVE][c["label"]], times[UNENCRYPTED][c["label"]])
            row["curve_over_unencrypted_time"] = median([a / b for a, b in pairs])
        if "TF ring" in t:
            row["speedup_over_tf_ring"] = t["TF ring"] / bps
        if "bps_tf TF op" in t:
            row["tf_op_over_tcp_bound"] = t["tcp-echo bound"] / t["bps_tf TF op"]
            row["tf_op_over_bound"] = t[bound] / t["bps_tf TF op"]
            if "TF ring" in t:
                row["tf_op_speedup_over_tf_ring"] = t["TF ring"] / t["bps_tf TF op"]
        rows.append(row)

    names = list(runners)
    headers = ["size"] + [f"{n} ms" for n in names] + [f"{n} GB/s" for n in names] + \
        ["bps/bound", "op/bound", "bps vs TF"] + \
        (["enc/no-enc time"] if UNENCRYPTED in names else []) + \
        (["curve/no-enc time"] if CURVE in names else [])
    table = [[r["label"]] + [r["seconds"][n] * 1e3 for n in names] +
             [r["bus_GBps"][n] for n in names] +
             [r["bps_over_bound"], r.get("tf_op_over_bound", float("nan")),
              r.get("speedup_over_tf_ring", float("nan"))] +
             ([r["encrypted_over_unencrypted_time"]] if UNENCRYPTED in names else []) +
             ([r["curve_over_unencrypted_time"]] if CURVE in names else [])
             for r in rows]
    common.print_table(f"push_pull, {args.workers} workers x {args.servers} servers on loopback "
                       f"(median of repetitions; bus bandwidth = 2*size/time per worker; "
                       f"bound = {bound})", headers, table)
    out = common.write_json("push_pull_bandwidth", {
        "workers": args.workers, "servers": args.servers, "rounds": args.rounds,
        "tf_api": args.tf_api, "encryption": args.encryption, "echo": args.echo,
        "ipc": args.ipc, "bound": bound,
        "columns": names, "rows": rows,
        "targets": {"64MiB bps/bound": ">= 0.80", "64MiB bps vs TF ring": ">= 3.0",
                    "4MiB and 64MiB enc/no-enc time over TCP": "<= 1.25"}},
        args.out_dir)
    if not args.no_plot:
        plot(rows, names, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    common.run_main(main)
