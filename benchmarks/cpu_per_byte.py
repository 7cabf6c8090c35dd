"""CPU per byte of every data path a user can run: core-nanoseconds of CPU,
over all the processes of a job, per byte pushed and pulled.

    python benchmarks/cpu_per_byte.py [--sizes 4MiB,64MiB] [--rounds 3]
        [--workers 2] [--servers 2] [--skip NAME,...]

Columns, each a job of W workers x S servers on loopback (W x S echo
clients/servers; W Horovod ranks), run once per round, rounds interleaved:

* TCP clear: push_pull over TCP (BYTEPS_ENABLE_IPC=0), BYTEPS_ENCRYPTION=0;
* TCP sealed: the same with encryption on (BYTEPS_ENCRYPTION=1, the default:
  a handshake keyed by the token, then an AEAD from libsodium per message);
* TCP CURVE: the same with ZeroMQ CURVE (BYTEPS_ENCRYPTION=curve);
* Unix sockets: the defaults on one machine (BYTEPS_ENABLE_IPC=1: workers
  reach the servers over Unix sockets, authenticated, not encrypted);
* C++ echo TCP / Unix: benchmarks/echo/ps_echo.cc, the data movement of a
  push_pull without sums, Python or ZeroMQ;
* Horovod-gloo: allreduce of the same tensor by W ranks, when
  benchmarks/.hvd-venv exists (benchmarks/setup_horovod.sh).

A thread samples the CPU time of every process of the job (and their
children) every 20 ms, from /proc/PID/stat (utime + stime: every thread the
process ever ran, the ones that have exited included; 10 ms ticks, so a
case's few CPU-seconds are read to about 1 %). The CPU of a case is the
sampled total interpolated between the first timed repetition's start and
the last one's end (the workers' clocks are this machine's CLOCK_MONOTONIC);
bytes = W x reps x 2 x size (each worker pushes its tensor and pulls the
sum). Ratios are per round against the baseline column (TCP clear) measured
in the same round, then the median over rounds; the targets of issue 37
(sealed over clear, clear over the echo) are printed the same way, with
their range over rounds. This is what says how many cores a worker and its
servers need to feed a 25 or 100 Gbps link, which no machine here has.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, cxx_echo, hvd_peer  # noqa: E402
from benchmarks.common import PYTHON, WORKERS_DIR, fmt_size, median  # noqa: E402

BASELINE = "TCP clear"
# (what, numerator column, denominator column, index in a (seconds, core-ns per
# byte) result, target): the ratios issue 37 set, each taken within one round.
TARGETS = [
    ("CPU", "TCP sealed", "TCP clear", 1, "<= 1.5"),
    ("time", "TCP sealed", "TCP clear", 0, "<= 1.25"),
    ("CPU", "TCP clear", "C++ echo TCP", 1, "<= 1.3"),
]
TCP = {"BYTEPS_ENABLE_IPC": "0"}
BPS_COLUMNS = {
    "TCP clear": dict(TCP, BYTEPS_ENCRYPTION="0"),
    "TCP sealed": dict(TCP, BYTEPS_ENCRYPTION="1"),
    "TCP CURVE": dict(TCP, BYTEPS_ENCRYPTION="curve"),
    "Unix sockets": {"BYTEPS_ENABLE_IPC": "1", "BYTEPS_ENCRYPTION": "1"},
}
SAMPLE_S = 0.02


CLOCK_TICK_NS = 1e9 / os.sysconf("SC_CLK_TCK")


def _cpu_ns(pid: int) -> int:
    """CPU time of one process so far (ns), over all its threads, those that
    have exited too. (Summing /proc/PID/task/*/schedstat, precise to the ns,
    loses a thread's time when it exits: the C++ echo's client starts a thread
    per connection for each repetition, and most of its CPU went uncounted.)"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # fields after the command name, which may hold spaces: state is
            # field 3, utime and stime fields 14 and 15 (in clock ticks)
            fields = f.read().rsplit(")", 1)[1].split()
        return int((int(fields[11]) + int(fields[12])) * CLOCK_TICK_NS)
    except (OSError, ValueError, IndexError):
        return -1


def _children(pid: int) -> set:
    """The live children of one process (/proc/PID/task/TID/children of
    each of its threads: a few small reads, cheap enough for every sample)."""
    out = set()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.update(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return out


def _descendants(roots) -> set:
    """`roots` and the processes they started, at any depth."""
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(_children(pid))
    return found


class CpuSampler:
    """Samples the total CPU time of a job's processes, as (time, ns) pairs;
    a process that exits keeps its last reading, so the total never drops."""

    def __init__(self, procs: common.Processes):
        self.procs = procs
        self.samples = []
        self.last = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.thread.join()

    def _run(self):
        members = set()
        while not self.stopping.is_set():
            # Every sample: a short job's processes may start and end
            # between two samples otherwise, and go uncounted.
            members |= _descendants({c.popen.pid for c in self.procs.children})
            for pid in members:
                ns = _cpu_ns(pid)
                if ns >= self.last.get(pid, 0):
                    self.last[pid] = ns
            self.samples.append((time.perf_counter(), sum(self.last.values())))
            self.stopping.wait(SAMPLE_S)

    def at(self, t: float) -> float:
        """The total CPU (ns) at time t, interpolated between samples."""
        s = self.samples
        if not s or t <= s[0][0] or t >= s[-1][0]:
            raise common.JobFailed("the CPU sampler did not cover a timed region")
        lo, hi = 0, len(s) - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if s[mid][0] <= t else (lo, mid)
        (t0, c0), (t1, c1) = s[lo], s[hi]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0)


def measure(results, cases, sampler, workers):
    """{label: (median repetition s, core-ns per byte)} of one job."""
    out = {}
    for i, case in enumerate(cases):
        per_worker = [r["cases"][i] for r in results]
        if not all(c.get("correct", True) for c in per_worker):
            raise common.JobFailed(f"wrong sums in case {case['label']}")
        start = min(c["starts"][0] for c in per_worker)
        end = max(c["ends"][-1] for c in per_worker)
        reps = min(len(c["ends"]) for c in per_worker)
        moved = workers * reps * 2 * case["bytes"]
        cpu = sampler.at(end) - sampler.at(start)
        if cpu <= 0:
            raise common.JobFailed(f"no CPU time sampled for case {case['label']}: the "
                                   "processes were not found, or the timed region is too short "
                                   "for the 20 ms sampling (use more --reps)")
        out[case["label"]] = (median(common.rep_durations(per_worker)), cpu / moved)
    return out


def run_bps(cases, workers, servers, env):
    with common.processes() as procs, CpuSampler(procs) as sampler:
        spec = common.write_spec(procs.log_dir, {"out_dir": str(procs.log_dir), "cases": cases})
        common.run_bps_job(procs, [PYTHON, str(WORKERS_DIR / "bps_numpy.py"), str(spec)],
                           num_workers=workers, num_servers=servers, timeout=1800, env=env)
        results = common.read_results(procs.log_dir, workers)
        time.sleep(3 * SAMPLE_S)  # a sample after the last repetition
    return measure(results, cases, sampler, workers)


def run_echo(cases, workers, servers, unix):
    with common.processes() as procs, CpuSampler(procs) as sampler:
        results = cxx_echo.run_job(procs, cases, num_clients=workers, num_servers=servers,
                                   unix=unix)
        time.sleep(3 * SAMPLE_S)
    return measure(results, cases, sampler, workers)


def run_horovod(cases, workers):
    with common.processes() as procs, CpuSampler(procs) as sampler:
        spec = common.write_spec(procs.log_dir, {"out_dir": str(procs.log_dir), "cases": cases})
        results = hvd_peer.run_job(procs, spec, num_workers=workers)
        time.sleep(3 * SAMPLE_S)
    return measure(results, cases, sampler, workers)


def repetitions(size: int) -> int:
    # A timed region of a few seconds on a 2-core machine, so the sampling's
    # 20 ms and the edges of the region stay small against it.
    return max(8, min(400, (1 << 30) // max(size, 1)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4MiB,64MiB")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=0,
                    help="timed repetitions per size (default: about 1 GiB moved per size)")
    ap.add_argument("--skip", default="", help="comma-separated column names to leave out")
    ap.add_argument("--out-dir", help="where the JSON goes (default benchmarks/results)")
    args = ap.parse_args(argv)

    sizes = common.parse_sizes(args.sizes)
    cases = [{"label": fmt_size(s).replace(" ", ""), "bytes": s, "warmup": args.warmup,
              "reps": args.reps or repetitions(s), "tensors": [["t", [max(1, s // 4)], 0]]} for s in sizes]
    w, s = args.workers, args.servers
    runners = {name: (lambda env=env: run_bps(cases, w, s, env)) for name, env in BPS_COLUMNS.items()}
    runners["C++ echo TCP"] = lambda: run_echo(cases, w, s, unix=False)
    runners["C++ echo Unix"] = lambda: run_echo(cases, w, s, unix=True)
    notes = []
    reason = hvd_peer.unavailable_reason()
    if reason is None:
        runners["Horovod-gloo"] = lambda: run_horovod(cases, w)
    else:
        notes.append(f"Horovod-gloo left out: {reason}")
        print(notes[-1])
    columns = list(BPS_COLUMNS) + ["C++ echo TCP", "C++ echo Unix", "Horovod-gloo"]
    for name in filter(None, (n.strip() for n in args.skip.split(","))):
        if name not in columns:
            ap.error(f"--skip: no column {name!r}; the columns are {', '.join(columns)}")
        runners.pop(name, None)
    if BASELINE not in runners:
        raise common.JobFailed(f"the baseline column '{BASELINE}' cannot be skipped")

    got = {name: {c["label"]: [] for c in cases} for name in runners}
    with common.stop_on_signals():
        for rnd in range(args.rounds):
            for name, run in runners.items():
                print(f"[round {rnd + 1}/{args.rounds}] {name} ...", flush=True)
                for label, value in run().items():
                    got[name][label].append(value)
    return report(args, cases, runners, got, notes)


def report(args, cases, runners, got, notes) -> int:
    rows = []
    for c in cases:
        label = c["label"]
        base = got[BASELINE][label]
        for name in runners:
            vals = got[name][label]
            rows.append({
                "size": label, "path": name, "reps": c["reps"],
                "ms": median(t for t, _ in vals) * 1e3,
                "ns_per_byte": median(n for _, n in vals),
                "ns_per_byte_rounds": [n for _, n in vals],
                "ms_rounds": [t * 1e3 for t, _ in vals],
                # per round against the baseline of that round, then the median
                "cpu_vs_baseline": median(round_ratios(vals, base, 1)),
                "time_vs_baseline": median(round_ratios(vals, base, 0)),
            })
    headers = ["size", "path", "ms per push_pull", "core-ns/byte", "GB/s per core",
               "CPU vs TCP clear", "time vs TCP clear"]
    table = [[r["size"], r["path"], r["ms"], r["ns_per_byte"], 1 / r["ns_per_byte"],
              r["cpu_vs_baseline"], r["time_vs_baseline"]] for r in rows]
    common.print_table(f"CPU per byte moved, {args.workers} workers x {args.servers} servers on "
                       f"loopback (all processes' CPU / bytes pushed + pulled; median of "
                       f"{args.rounds} interleaved rounds)", headers, table)
    checks = target_checks(cases, got)
    if checks:
        common.print_table("targets (per round, then the median and the range over rounds)",
                           ["size", "ratio", "target", "median", "min", "max"],
                           [[c["size"], c["ratio"], c["target"], c["median"], c["min"], c["max"]]
                            for c in checks])
    for n in notes:
        print(n)
    common.write_json("cpu_per_byte", {
        "workers": args.workers, "servers": args.servers, "rounds": args.rounds,
        "baseline": BASELINE, "columns": list(runners), "notes": notes, "rows": rows,
        "targets": {f"{name}: {num} vs {den}": target for name, num, den, _, target in TARGETS},
        "target_checks": checks}, args.out_dir)
    return 0


def round_ratios(vals, base, index):
    """Item `index` of each round's (seconds, core-ns per byte) result over
    the same item of the `base` column's result in that round."""
    return [a[index] / b[index] for a, b in zip(vals, base)]


def target_checks(cases, got):
    out = []
    for c in cases:
        label = c["label"]
        for what, num, den, index, target in TARGETS:
            if num not in got or den not in got:
                continue
            ratios = round_ratios(got[num][label], got[den][label], index)
            out.append({"size": label, "ratio": f"{what}: {num} / {den}", "target": target,
                        "median": median(ratios), "min": min(ratios), "max": max(ratios),
                        "rounds": ratios})
    return out


if __name__ == "__main__":
    common.run_main(main)
