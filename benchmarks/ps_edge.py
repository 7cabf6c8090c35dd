"""The parameter server's edge over ring all-reduce as the worker count grows.

    sudo python benchmarks/ps_edge.py                      # n = 2, 4, 8 at 100 mbit
    sudo python benchmarks/ps_edge.py --sizes 2,4,8,16 --rate 200mbit --rounds 2

Per n, in one run on the same hosts: n worker hosts and n server hosts, each
a network namespace with a tc-capped link (benchmarks/netns_hosts.py), slow
enough that the links, not this machine's CPUs, bound a step. The gradient
set is sized so a parameter-server step takes about --seconds at the link
rate: M = rate x seconds bytes, in 4n float32 tensors. Columns:

* bound (C++ echo): the raw-TCP data movement of a push_pull (each worker
  sends M split over the servers and gets it back; benchmarks/echo);
* bps_tf: push_pull of the set by numpy workers (the engine of the TF op,
  without TensorFlow's start-up), n servers, default settings;
* bps_tf, BYTEPS_LINK_RATE: the same with BYTEPS_LINK_RATE=--rate, which
  sizes partitions and credit to the link (--no-link-rate leaves it out);
* Horovod-gloo: hvd.allreduce of the same tensors on the n worker hosts
  (benchmarks/.hvd-venv from setup_horovod.sh; left out, with the reason,
  without it);
* TF ring: MultiWorkerMirroredStrategy (RING) on the n worker hosts.

Theory (BytePS, OSDI'20, section 2): per worker link a ring all-reduce moves
2(n-1)/n M each way and a parameter server with n servers M, so the edge is
2(n-1)/n: 1.0 at n = 2, 1.5 at 4, 1.75 at 8, 1.875 at 16. Reported: each
column's step time, the measured edge t(all-reduce) / t(bps_tf) for Horovod
and TF's ring, and that edge over the theory (target >= 0.9). Every job runs
without encryption (BYTEPS_ENCRYPTION=0), as gloo and TF's gRPC send in clear.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, cxx_echo, hvd_peer, netns_cluster  # noqa: E402
from benchmarks.common import median  # noqa: E402
from benchmarks.netns_hosts import NetnsHosts, NetnsUnavailable  # noqa: E402

ECHO, BPS, HVD, RING = "bound (C++ echo)", "bps_tf", "Horovod-gloo", "TF ring"
TUNED = "bps_tf, BYTEPS_LINK_RATE"
# The second bps_tf column: the same job with BYTEPS_LINK_RATE set to the
# links' rate, which sizes partitions and credit to the link instead of the
# defaults' 1 MiB partitions and 8 MiB credit (sized for loopback and
# 10 Gbit): a worker's pushes then leave in waves of about 20 ms of the link
# spread over the servers, so each server's first sums are ready, and go
# back, while later pushes still travel; with the defaults every tensor is
# in flight at once and the sums come back only after the pushes end
# (docs/scaling.md#the-edge-as-n-grows).


def gradient_case(n: int, total_bytes: int, warmup: int, reps: int) -> dict:
    """4n float32 tensors adding up to about total_bytes, priorities in order."""
    count = 4 * n
    elems = max(1, total_bytes // (4 * count))
    tensors = [[f"g{i}", [elems], -i] for i in range(count)]
    return {"label": f"n{n}", "warmup": warmup, "reps": reps, "tensors": tensors,
            "bytes": 4 * elems * count}


def runners(net, n: int, case: dict, args, horovod: bool):
    workers, servers = net.hosts[:n], net.hosts[n:2 * n]
    env = dict({"BYTEPS_ENCRYPTION": "0"}, **args.bps_env)

    def echo():
        echo_case = {k: case[k] for k in ("label", "warmup", "reps", "bytes")}
        with common.processes() as procs:
            results = cxx_echo.run_job(procs, [echo_case], num_clients=n, num_servers=n,
                                       client_hosts=workers, server_hosts=servers,
                                       timeout=args.timeout)
        return median(common.rep_durations([r["cases"][0] for r in results]))

    def bps():
        return median(netns_cluster.run_bps(net, case, n, n, "bps_numpy.py", env=env))

    def tuned():
        return median(netns_cluster.run_bps(net, case, n, n, "bps_numpy.py",
                                            env=dict(env, BYTEPS_LINK_RATE=args.rate)))

    def hvd():
        with common.processes() as procs:
            spec = common.write_spec(procs.log_dir, {"out_dir": str(procs.log_dir),
                                                     "cases": [case]})
            results = hvd_peer.run_job(procs, spec, num_workers=n, hosts=workers,
                                       timeout=args.timeout)
        return median(netns_cluster.step_times(results))

    def ring():
        return median(netns_cluster.run_tf(net, case, n))

    plan = {ECHO: echo, BPS: bps}
    if not args.no_link_rate:
        plan[TUNED] = tuned
    if horovod:
        plan[HVD] = hvd
    if not args.no_tf:
        plan[RING] = ring
    return plan


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def measure(n: int, args, horovod: bool, failures: dict) -> dict:
    rate = common.parse_rate(args.rate)
    case = gradient_case(n, int(rate * args.seconds), args.warmup, args.reps)
    m = case["bytes"]
    row = {"n": n, "rate": args.rate, "gradient_bytes": m, "tensors": len(case["tensors"]),
           "load_before": load(), "seconds": {}, "all_rounds": {}}
    with NetnsHosts(2 * n, rate=args.rate, host_nic=args.host_nic) as net:
        if args.no_idle_restart:
            for name in net.names:
                common.subprocess.run(["ip", "netns", "exec", name, "sysctl", "-qw",
                                       "net.ipv4.tcp_slow_start_after_idle=0"], check=True)
        print(f"\nn = {n}: {net.describe()}; {m / 1e6:.1f} MB in {len(case['tensors'])} "
              f"tensors (load {row['load_before']})", flush=True)
        plan = runners(net, n, case, args, horovod)
        for rnd in range(args.rounds):
            for name, run in plan.items():
                if name in failures.get(n, {}):
                    continue
                print(f"  [round {rnd + 1}/{args.rounds}] {name} ...", flush=True)
                t0 = time.monotonic()
                try:
                    row["all_rounds"].setdefault(name, []).append(run())
                except common.JobFailed as exc:
                    print(f"  {name} FAILED: {str(exc)[:400]}", file=sys.stderr, flush=True)
                    failures.setdefault(n, {})[name] = str(exc)[:2000]
                    continue
                print(f"    {row['all_rounds'][name][-1]:.3f} s per step "
                      f"({time.monotonic() - t0:.0f} s)", flush=True)
    row["load_after"] = load()
    row["seconds"] = {k: median(v) for k, v in row["all_rounds"].items()}
    theory = 2 * (n - 1) / n
    row["bound_ps_s"] = m / rate
    row["bound_ring_s"] = theory * m / rate
    row["theory_edge"] = theory
    t = row["seconds"]
    for ours, tag in ((BPS, ""), (TUNED, "tuned_")):
        if ours not in t:
            continue
        row[f"{tag}bps_over_bound"] = row["bound_ps_s"] / t[ours]
        for name in (HVD, RING):
            if name in t:
                # Per round, then the median: both from the same round's load.
                pairs = [a / b for a, b in zip(row["all_rounds"][name], row["all_rounds"][ours])]
                row[f"{tag}edge_{name}"] = median(pairs)
                row[f"{tag}edge_{name}_over_theory"] = median(pairs) / theory
                row[f"{name}_over_ring_bound"] = row["bound_ring_s"] / t[name]
    if ECHO in t:
        row["echo_over_bound"] = row["bound_ps_s"] / t[ECHO]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2,4,8", help="worker counts n (n servers each)")
    ap.add_argument("--rate", default="100mbit", help="every host's link, each way (tc tbf)")
    ap.add_argument("--seconds", type=float, default=1.0,
                    help="a parameter-server step's time at the link rate: sizes the gradients")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved repetitions of each column")
    ap.add_argument("--host-nic", default="paced", choices=("tbf", "paced"),
                    help="a host's egress: paced (TCP held in its socket as by a NIC, the "
                         "default) or tbf (a short drop-tail queue)")
    ap.add_argument("--no-idle-restart", action="store_true",
                    help="net.ipv4.tcp_slow_start_after_idle=0 on every host")
    ap.add_argument("--no-horovod", action="store_true")
    ap.add_argument("--no-tf", action="store_true")
    ap.add_argument("--no-link-rate", action="store_true",
                    help="leave out the bps_tf column with BYTEPS_LINK_RATE set to --rate")
    ap.add_argument("--bps-env", action="append", default=[], metavar="NAME=VALUE",
                    help="a setting for the bps_tf jobs (repeatable)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--out-dir")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x]
    args.bps_env = dict(item.split("=", 1) for item in args.bps_env)
    notes = []
    horovod = hvd_peer.column(args.no_horovod, "ps_edge", notes)
    cxx_echo.build()
    rows, failures = [], {}
    try:
        with common.stop_on_signals():
            for n in sizes:
                rows.append(measure(n, args, horovod, failures))
    except NetnsUnavailable as exc:
        print(f"ps_edge: {exc}", file=sys.stderr)
        return 2
    names = [ECHO, BPS] + ([] if args.no_link_rate else [TUNED]) + \
        ([HVD] if horovod else []) + ([] if args.no_tf else [RING])
    common.print_table(
        f"seconds per step, {args.rate} links, M = {args.rate} x {args.seconds:g} s "
        f"(bounds: M/B for push/pull, 2(n-1)/n M/B for a ring)",
        ["n", "M/B", "ring bound"] + names + ["load after"],
        [[r["n"], r["bound_ps_s"], r["bound_ring_s"]] +
         [r["seconds"].get(k, float("nan")) for k in names] + [r["load_after"]] for r in rows])
    edge_rows = []
    for r in rows:
        for ours, tag in ((BPS, ""), (TUNED, "tuned_")):
            if ours in r["seconds"]:
                edge_rows.append([r["n"], ours, r["theory_edge"]] + [
                    r.get(f"{tag}{key}", float("nan")) for key in (
                        f"edge_{HVD}", f"edge_{HVD}_over_theory", f"edge_{RING}",
                        f"edge_{RING}_over_theory", "bps_over_bound")] +
                    [r.get("echo_over_bound", float("nan"))])
    common.print_table(
        "the edge: t(all-reduce) / t(bps_tf) per round, median; theory 2(n-1)/n; target: "
        "edge / theory >= 0.9",
        ["n", "bps_tf", "theory", "vs Horovod", "/ theory", "vs TF ring", "/ theory",
         "bps/bound", "echo/bound"], edge_rows)
    for note in notes:
        print(f"note: {note}")
    for n, cols in failures.items():
        for name, why in cols.items():
            print(f"FAILED (n = {n}) {name}: {why.splitlines()[0]}")
    common.write_json("ps_edge", {"args": vars(args), "rows": rows, "notes": notes,
                                  "failures": {str(k): v for k, v in failures.items()}},
                      args.out_dir)
    return 1 if failures else 0


if __name__ == "__main__":
    common.run_main(main)
