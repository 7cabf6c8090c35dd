"""Where the CPU goes during push_pulls: `perf` samples of every process of a
loopback job, summed per process, per thread and per function.

    python benchmarks/profile_push_pull.py [--size 64MiB] [--path numpy|tf-op]

Starts W workers x S servers (numpy workers or the TF op), waits until every
worker finished its warm-up, records `perf record -F 999` on exactly those
processes for a few seconds, and prints CPU-seconds per repetition for each
process and thread kind, and the top functions. Needs `perf` and permission
to profile the processes (root, or kernel.perf_event_paranoid <= 1).
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.common import PYTHON, WORKERS_DIR, median  # noqa: E402

HZ = 999
# "comm pid/tid ip sym (dso)", one line per sample without call chains
SAMPLE = re.compile(r"^\s*(\S+)\s+(\d+)/\d+\s+[0-9a-f]+\s+(.*?)\s+\((.*)\)\s*$")


def record(procs, warm_files, seconds: float, out: Path, result: dict) -> None:
    deadline = time.monotonic() + 300
    while not all(f.exists() for f in warm_files):
        if time.monotonic() > deadline:
            result["error"] = "workers did not finish their warm-up"
            return
        time.sleep(0.05)
    result["names"] = {c.popen.pid: c.name for c in procs.children}
    result["t0"] = time.perf_counter()
    pids = ",".join(str(pid) for pid in result["names"])
    proc = subprocess.run(["perf", "record", "-F", str(HZ), "-o", str(out), "-p", pids, "--",
                           "sleep", str(seconds)], capture_output=True, text=True)
    result["t1"] = time.perf_counter()
    if proc.returncode != 0:
        result["error"] = (f"perf record failed (if the job ended inside the {seconds:g} s "
                           f"window, use a smaller --seconds): {proc.stderr.strip()[-500:]}")


def summarize(data: Path, names: dict, reps_in_window: float, top: int):
    script = subprocess.run(["perf", "script", "-i", str(data), "-F", "comm,pid,tid,ip,sym,dso"],
                            capture_output=True, text=True).stdout
    per_process = collections.Counter()
    per_thread = collections.Counter()
    per_symbol = collections.Counter()
    for line in script.splitlines():
        m = SAMPLE.match(line)
        if not m:
            continue
        comm, pid, sym, dso = m.group(1), int(m.group(2)), m.group(3), Path(m.group(4)).name
        sym = sym.split("+0x")[0] or "?"
        name = names.get(pid, f"pid {pid}")
        role = name.rstrip("0123456789")
        # The engine names its threads (bps-io, bps-sum, ...); the rest of
        # the interpreter's keep its name: the program, a server's I/O loop.
        kind = "python (main)" if comm.startswith("python") else comm.rstrip("0123456789")
        per_process[name] += 1
        per_thread[(role, kind)] += 1
        per_symbol[(role, kind, f"{sym} ({dso})")] += 1
    scale = 1.0 / HZ / max(reps_in_window, 1e-9) * 1e3   # samples -> CPU ms per repetition
    return per_process, per_thread, per_symbol, scale


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="64MiB", help="bytes of each tensor")
    ap.add_argument("--tensors", type=int, default=1,
                    help="tensors per repetition, all in flight at once (e.g. 256 x 4KiB)")
    ap.add_argument("--path", choices=("numpy", "tf-op"), default="numpy")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    if shutil.which("perf") is None:
        print("profile_push_pull: `perf` is not installed", file=sys.stderr)
        return 2
    size = common.parse_size(args.size)
    script = "bps_numpy.py" if args.path == "numpy" else "bps_tf_op.py"
    with common.stop_on_signals(), common.processes() as procs:
        warm = [procs.log_dir / f"warm{r}" for r in range(args.workers)]
        # Enough repetitions to outlast the recording window even on a fast
        # machine (perf fails when the processes it records exit first).
        per_rep_s = max(args.tensors * size / 1.5e9, args.tensors * 2e-5)
        reps = max(10, int(2 * args.seconds / per_rep_s) + 10)
        case = {"label": common.fmt_size(size).replace(" ", ""), "warmup": 3, "reps": reps,
                "tensors": [[f"t{i}", [size // 4], 0] for i in range(args.tensors)],
                "warm_file": str(procs.log_dir / "warm{rank}")}
        spec = common.write_spec(procs.log_dir, {"out_dir": str(procs.log_dir), "cases": [case]})
        result = {}
        recorder = threading.Thread(target=record, args=(procs, warm, args.seconds,
                                                         procs.log_dir / "perf.data", result))
        recorder.start()
        common.run_bps_job(procs, [PYTHON, str(WORKERS_DIR / script), str(spec)],
                           num_workers=args.workers,
                           num_servers=args.servers, timeout=900)
        recorder.join()
        if "error" in result:
            print(f"profile_push_pull: {result['error']}", file=sys.stderr)
            return 1
        results = common.read_results(procs.log_dir, args.workers)
        per_worker = [r["cases"][0] for r in results]
        durations = common.rep_durations(per_worker)
        ends = [max(r["ends"][k] for r in per_worker) for k in range(len(durations))]
        in_window = sum(1 for e in ends if result["t0"] <= e <= result["t1"])
        per_process, per_thread, per_symbol, scale = summarize(
            procs.log_dir / "perf.data", result["names"], in_window, args.top)

    print(f"\n{args.path} path, {args.tensors} x {args.size}, {args.workers} workers x "
          f"{args.servers} servers: "
          f"median repetition {median(durations) * 1e3:.1f} ms; {in_window} repetitions in "
          f"the {args.seconds:.0f} s window")
    common.print_table("CPU ms per repetition, per process",
                       ["process", "CPU ms"], [[k, v * scale] for k, v in per_process.most_common()])
    common.print_table("CPU ms per repetition, per role and thread",
                       ["role", "thread", "CPU ms"],
                       [[r, t, v * scale] for (r, t), v in per_thread.most_common(12)])
    common.print_table("top functions (CPU ms per repetition)",
                       ["role", "thread", "function", "CPU ms"],
                       [[r, t, f[:60], v * scale]
                        for (r, t, f), v in per_symbol.most_common(args.top)])
    return 0


if __name__ == "__main__":
    common.run_main(main)
