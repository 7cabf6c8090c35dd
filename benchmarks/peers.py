"""bps_tf against its peers in one run: the C++ raw-TCP bound, Horovod 0.28.1 +
gloo, and TensorFlow's ring all-reduce, on loopback and on namespace hosts.

    sudo python benchmarks/peers.py --quick    # 3 sizes, 1 gbit hosts; ~11 min at load 10-19 on 2 cores
    sudo python benchmarks/peers.py            # the full tables (see docs/performance.md)

Most of the time is process start-up (every column of every round starts
its processes afresh, TensorFlow's take seconds each), so a quiet machine is
much faster. Without root the namespace part is left out, with the reason.

Columns, every one measured in this run, in >= 3 interleaved rounds (round 1
runs each column once, then round 2, ...: a drift in the machine's load hits
every column alike):

* bound: benchmarks/echo/ps_echo.cc, the data movement of a push_pull in C++
  (each worker sends M/S to each of S servers and gets it back; no sums);
* unix bound (loopback only, unless bps_tf runs with BYTEPS_ENABLE_IPC=0):
  the same over abstract Unix sockets, which bps_tf uses between a worker
  and a server of one machine;
* bps_tf: the TF op (`push_pull_sum` in a tf.function, workers/bps_tf_op.py),
  W workers x S servers;
* Horovod: `hvd.allreduce(op=Sum)` of float32 in a tf.function over gloo
  (workers/hvd_allreduce.py, in benchmarks/.hvd-venv from setup_horovod.sh;
  without it the script says so and measures the others);
* TF ring: MultiWorkerMirroredStrategy, RING (workers/tf_allreduce.py).

Loopback: 2 workers x 2 servers (bound and bps_tf), 2 ranks (Horovod, TF
ring), one tensor per size. Namespace hosts (root; skipped with the reason
otherwise): 4 worker hosts + 4 server hosts with tc-capped links, the
ResNet-50 gradient set (214 tensors, 102 MB) per step; Horovod and TF ring run
on the 4 worker hosts. Ratios are of times from the same round (then the
median over rounds, and the min-max over rounds as the spread):
x/bound = t(bound) / t(x), vs Horovod = t(Horovod) / t(x) (> 1: faster).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, cxx_echo, hvd_peer, netns_cluster  # noqa: E402
from benchmarks import push_pull_bandwidth as ppb  # noqa: E402
from benchmarks.common import median  # noqa: E402
from benchmarks.netns_hosts import NetnsHosts, NetnsUnavailable  # noqa: E402

BOUND, BPS, HVD, RING = "bound (C++ echo)", "bps_tf TF op", "Horovod gloo", "TF ring"
UNIX_BOUND = "unix bound (C++ echo)"
COLUMNS = (BOUND, UNIX_BOUND, BPS, HVD, RING)
FULL_SIZES = ppb.DEFAULT_SIZES
QUICK_SIZES = "4KiB,1MiB,64MiB"
FULL_NETNS = "500mbit/1500,1gbit/1500,500mbit/9000"
QUICK_NETNS = "1gbit/1500"


# ------------------------------------------------------------------ one run of a column
def loopback_runners(cases, args, horovod: bool):
    """{column: () -> {label: median seconds}} for the loopback table."""
    w, s = args.workers, args.servers

    def hvd():
        with common.processes() as procs:
            spec = common.write_spec(procs.log_dir, {"out_dir": str(procs.log_dir),
                                                     "cases": cases})
            return ppb.case_times(hvd_peer.run_job(procs, spec, num_workers=w), len(cases))

    runners = {BOUND: lambda: ppb.run_echo(cases, w, s)}
    if args.bps_env.get("BYTEPS_ENABLE_IPC", os.environ.get("BYTEPS_ENABLE_IPC", "1")) != "0":
        runners[UNIX_BOUND] = lambda: ppb.run_echo(cases, w, s, unix=True)
    runners[BPS] = lambda: ppb.run_bps(cases, w, s, "bps_tf_op.py", args.bps_env)
    if horovod:
        runners[HVD] = hvd
    if not args.no_tf:
        runners[RING] = lambda: ppb.run_tf(cases, w)
    return runners


def netns_runners(net, case, args, horovod: bool):
    """{column: () -> {label: median step seconds}} on namespace hosts."""
    w, s, label = args.netns_workers, args.netns_servers, case["label"]
    workers, servers = net.hosts[:w], net.hosts[w:w + s]

    def echo():
        echo_case = {k: case[k] for k in ("label", "warmup", "reps", "bytes")}
        with common.processes() as procs:
            results = cxx_echo.run_job(procs, [echo_case], num_clients=w, num_servers=s,
                                       client_hosts=workers, server_hosts=servers, timeout=3600)
        return {label: median(common.rep_durations([r["cases"][0] for r in results]))}

    def bps():
        return {label: median(netns_cluster.run_bps(net, case, w, s, "bps_tf_op.py",
                                                    env=args.bps_env))}

    def hvd():
        with common.processes() as procs:
            spec = common.write_spec(procs.log_dir, {"out_dir": str(procs.log_dir),
                                                     "cases": [case]})
            results = hvd_peer.run_job(procs, spec, num_workers=w, hosts=workers, timeout=3600)
        return {label: median(netns_cluster.step_times(results))}

    def ring():
        return {label: median(netns_cluster.run_tf(net, case, w))}

    runners = {BOUND: echo, BPS: bps}
    if horovod:
        runners[HVD] = hvd
    if not args.no_tf:
        runners[RING] = ring
    return runners


def run_rounds(title: str, runners, labels, rounds: int, failures: dict):
    """{column: {label: [seconds per round]}}; a column that fails is reported
    and left out of the later rounds (the others go on)."""
    times = {name: {label: [] for label in labels} for name in runners}
    for rnd in range(rounds):
        for name, run in runners.items():
            if name in failures.get(title, {}):
                continue
            print(f"[{title}, round {rnd + 1}/{rounds}] {name} ...", flush=True)
            t0 = time.monotonic()
            try:
                for label, t in run().items():
                    times[name][label].append(t)
            except common.JobFailed as exc:
                print(f"  {name} FAILED: {exc}", file=sys.stderr, flush=True)
                failures.setdefault(title, {})[name] = str(exc)[:2000]
                continue
            print(f"  {time.monotonic() - t0:.0f} s", flush=True)
    return times


# ------------------------------------------------------------------ ratios
def summarize(times, label: str) -> dict:
    """Medians, spreads and per-round ratios of one row."""
    per = {n: times[n][label] for n in times if times[n][label]}
    row = {"seconds": {n: median(v) for n, v in per.items()},
           "spread_seconds": {n: [min(v), max(v)] for n, v in per.items()},
           "all_rounds_seconds": per, "ratios": {}}

    def ratio(num: str, den: str, key: str):
        if num in per and den in per:
            pairs = [a / b for a, b in zip(per[num], per[den])]
            row["ratios"][key] = {"median": median(pairs), "min": min(pairs), "max": max(pairs)}

    for n in (BPS, HVD, RING):
        ratio(BOUND, n, f"{n} / bound")
    ratio(UNIX_BOUND, BPS, f"{BPS} / unix bound")
    ratio(HVD, BPS, f"{BPS} vs {HVD}")
    ratio(RING, BPS, f"{BPS} vs {RING}")
    return row


def cell_time(row, name: str, scale: float = 1e3) -> str:
    if name not in row["seconds"]:
        return "-"
    lo, hi = row["spread_seconds"][name]
    return f"{fmt(row['seconds'][name] * scale)} ({fmt(lo * scale)}-{fmt(hi * scale)})"


def cell_ratio(row, key: str) -> str:
    r = row["ratios"].get(key)
    return "-" if r is None else f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"


def fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"


RATIO_KEYS = (f"{BPS} / bound", f"{BPS} / unix bound", f"{HVD} / bound", f"{RING} / bound",
              f"{BPS} vs {HVD}", f"{BPS} vs {RING}")
RATIO_HEADERS = ("bps/bound", "bps/unix", "hvd/bound", "ring/bound", "bps vs hvd",
                 "bps vs ring")


def print_tables(title: str, first: str, rows, unit: str, scale: float) -> None:
    common.print_table(f"{title}: {unit}, median (min-max) over rounds",
                       [first] + list(COLUMNS),
                       [[r["label"]] + [cell_time(r, n, scale) for n in COLUMNS] for r in rows])
    common.print_table(f"{title}: ratios of times from the same round, median (min-max)",
                       [first] + list(RATIO_HEADERS),
                       [[r["label"]] + [cell_ratio(r, k) for k in RATIO_KEYS] for r in rows])


# ------------------------------------------------------------------ plot
def plot(loop_rows, net_rows, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    panels = [p for p in (loop_rows, net_rows) if p]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.3), squeeze=False)
    axes = list(axes[0])
    if loop_rows:
        ax = axes.pop(0)
        sizes = [r["bytes"] for r in loop_rows]
        for name in COLUMNS:
            pts = [(r["bytes"], r) for r in loop_rows if name in r["seconds"]]
            if not pts:
                continue
            xs = [x for x, _ in pts]
            ys = [r["seconds"][name] * 1e3 for _, r in pts]
            err = [[y - r["spread_seconds"][name][0] * 1e3 for y, (_, r) in zip(ys, pts)],
                   [r["spread_seconds"][name][1] * 1e3 - y for y, (_, r) in zip(ys, pts)]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [r["label"] for r in loop_rows], rotation=30)
        ax.set_xlabel("tensor size")
        ax.set_ylabel("ms per all-reduce / push_pull (lower is better)")
        ax.set_title("loopback, 2 workers (x 2 servers)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if net_rows:
        ax = axes.pop(0)
        width = 0.8 / len(COLUMNS)
        for j, name in enumerate(COLUMNS):
            xs, ys, lo, hi = [], [], [], []
            for i, r in enumerate(net_rows):
                if name in r["seconds"]:
                    y = r["seconds"][name]
                    xs.append(i + j * width)
                    ys.append(y)
                    lo.append(y - r["spread_seconds"][name][0])
                    hi.append(r["spread_seconds"][name][1] - y)
            if xs:
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=name)
        for i, r in enumerate(net_rows):
            ax.hlines(r["bound_m_over_b"], i - width / 2, i + 0.8 - width / 2, colors="black",
                      linestyles="dashed", label="M/B" if i == 0 else None)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(net_rows))],
                      [r["label"] for r in net_rows])
        ax.set_ylabel("seconds per step (lower is better)")
        ax.set_title("ResNet-50 gradients, 4 worker hosts (+4 server hosts)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# ------------------------------------------------------------------ main
def parse_netns(text: str):
    """'500mbit/1500,500mbit/9000' -> [(rate, mtu)]."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        rate, _, mtu = item.partition("/")
        common.parse_rate(rate)
        out.append((rate, int(mtu or 1500)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"loopback {QUICK_SIZES}, namespace hosts {QUICK_NETNS}, fewer steps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", help=f"loopback sizes (default {FULL_SIZES})")
    ap.add_argument("--netns", help=f"namespace settings rate/mtu,... (default {FULL_NETNS}); "
                                    "'none' skips them")
    ap.add_argument("--no-loopback", action="store_true")
    ap.add_argument("--no-horovod", action="store_true")
    ap.add_argument("--no-tf", action="store_true", help="skip TensorFlow's ring all-reduce")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--netns-workers", type=int, default=4)
    ap.add_argument("--netns-servers", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, help="timed steps on namespace hosts (default 5, quick 2)")
    ap.add_argument("--encryption", choices=("off", "on"), default="off",
                    help="BYTEPS_ENCRYPTION of the bps_tf jobs (default off: gloo and TF's "
                         "gRPC ring send in clear too)")
    ap.add_argument("--host-nic", default="tbf", choices=("tbf", "paced"),
                    help="how each host's egress is modelled (benchmarks/netns_hosts.py): tbf, a "
                         "short drop-tail queue (earlier results); paced, TCP held back in its "
                         "socket as by a NIC at the link rate (no host drops)")
    ap.add_argument("--bps-env", dest="bps_env_list", action="append", default=[],
                    metavar="NAME=VALUE",
                    help="a setting for the bps_tf jobs (repeatable), e.g. "
                         "BYTEPS_LOCAL_REDUCE=1 (on loopback both workers share one host)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--out-dir")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    args.bps_env = {"BYTEPS_ENCRYPTION": "1" if args.encryption == "on" else "0"}
    for item in args.bps_env_list:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("BYTEPS_"):
            ap.error(f"--bps-env {item!r}: expected BYTEPS_NAME=VALUE")
        args.bps_env[name] = value
    started = time.monotonic()
    sizes = common.parse_sizes(args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES))
    try:
        netns = [] if args.netns == "none" else parse_netns(
            args.netns or (QUICK_NETNS if args.quick else FULL_NETNS))
    except ValueError as exc:
        ap.error(f"--netns: {exc} (format: RATE/MTU,..., e.g. 1gbit/1500,500mbit/9000)")
    steps = args.steps or (2 if args.quick else 5)

    notes = []
    horovod = hvd_peer.column(args.no_horovod, "peers", notes)
    cxx_echo.build()   # a compile error stops the run here, not in round 1

    failures: dict = {}
    loop_rows, net_rows = [], []
    with common.stop_on_signals():
        if not args.no_loopback:
            cases = ppb.make_cases(sizes, args.quick, args.warmup)
            times = run_rounds("loopback", loopback_runners(cases, args, horovod),
                               [c["label"] for c in cases], args.rounds, failures)
            for c in cases:
                loop_rows.append(dict(summarize(times, c["label"]), label=c["label"],
                                      bytes=c["bytes"], reps=c["reps"]))
            print_tables(f"loopback, {args.workers} workers x {args.servers} servers "
                         f"({args.workers} ranks for Horovod and TF ring)", "size",
                         loop_rows, "ms per push_pull / all-reduce", 1e3)
        case = netns_cluster.resnet50_case(1, steps)
        try:
            for mtu in sorted({m for _, m in netns}):
                with NetnsHosts(args.netns_workers + args.netns_servers, mtu=mtu,
                                host_nic=args.host_nic) as net:
                    for rate, _ in [x for x in netns if x[1] == mtu]:
                        net.set_rate(rate)
                        title = f"{rate} mtu {mtu}"
                        print(f"\n{net.describe()}", flush=True)
                        times = run_rounds(title, netns_runners(net, case, args, horovod),
                                           [case["label"]], args.rounds, failures)
                        row = dict(summarize(times, case["label"]), label=title, rate=rate,
                                   mtu=mtu, bound_m_over_b=case["bytes"] /
                                   common.parse_rate(rate))
                        net_rows.append(row)
        except NetnsUnavailable as exc:
            notes.append(f"namespace hosts left out: {exc}")
            print(f"peers: namespace hosts left out: {exc}", file=sys.stderr)
    if loop_rows and net_rows:
        print_tables("loopback (repeated from above)", "size", loop_rows, "ms", 1e3)
    if net_rows:
        print_tables(f"ResNet-50 gradient set ({case['bytes'] / 1e6:.0f} MB) per step, "
                     f"{args.netns_workers} worker hosts + {args.netns_servers} server hosts",
                     "link", net_rows, "s per step", 1)
        common.print_table("link bound M/B (bytes per worker link each way / rate)", ["link", "M/B s"],
                           [[r["label"], r["bound_m_over_b"]] for r in net_rows])
    elapsed = time.monotonic() - started
    for note in notes:
        print(f"note: {note}")
    for title, cols in failures.items():
        for name, reason in cols.items():
            print(f"FAILED ({title}) {name}: {reason.splitlines()[0]}")
    print(f"\npeers.py took {elapsed / 60:.1f} min")
    out = common.write_json("peers", {
        "quick": args.quick, "rounds": args.rounds, "elapsed_s": elapsed,
        "bps_env": args.bps_env,
        "loopback": {"workers": args.workers, "servers": args.servers, "rows": loop_rows},
        "netns": {"workers": args.netns_workers, "servers": args.netns_servers,
                  "gradient_bytes": case["bytes"], "tensors": len(case["tensors"]),
                  "steps": steps, "rows": net_rows},
        "columns": list(COLUMNS), "notes": notes, "failures": failures}, args.out_dir)
    if not args.no_plot:
        plot(loop_rows, net_rows, out.with_suffix(".png"))
    return 1 if failures else 0


if __name__ == "__main__":
    common.run_main(main)
