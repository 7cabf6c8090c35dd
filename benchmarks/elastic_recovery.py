"""How long an elastic job's survivors stand still after a worker is SIGKILLed.

    python benchmarks/elastic_recovery.py [--rounds 3] [--no-tf] [--no-baseline]

Each run is ``bpslaunch -np 2 --min-np 1`` (the default launch: the lost
worker is replaced); one worker SIGKILLs itself in the middle of an epoch,
and the time from that kill to the survivor's first step in the next
membership is the recovery time. Measured for:

- numpy workers (tests/workers/elastic_hosts.py: Horovod's elastic loop on the
  core's numpy push_pull, no TensorFlow): the launcher and scheduler alone;
- TensorFlow workers (benchmarks/workers/elastic_tf_loop.py: ``hvd.elastic.run``
  around a ``tf.function`` step with DistributedGradientTape, committed every
  batch): with the restore, the restart and the retrace;
- the baseline, in the same run: the numpy workers with
  ``BYTEPS_LAUNCHER_REPORTS=0`` (the scheduler notices the loss by heartbeats,
  after ``BYTEPS_TIMEOUT``, as before bpslaunch reported it).

Prints a table and writes benchmarks/results/elastic_recovery.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMPY_WORKER = os.path.join(ROOT, "tests", "workers", "elastic_hosts.py")
TF_WORKER = os.path.join(ROOT, "benchmarks", "workers", "elastic_tf_loop.py")
RESULTS = os.path.join(ROOT, "benchmarks", "results", "elastic_recovery.json")


def one_run(worker, extra_env, timeout):
    """Recovery seconds of one job, from its workers' event lines."""
    work = tempfile.mkdtemp(prefix="elastic_recovery_")
    times = os.path.join(work, "times")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **extra_env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env.pop("TF_CONFIG", None)
    args = ["--logfile", os.path.join(work, "log"), "--times", times, "--epochs", "3",
            "--batch-wait", "0.02", "--kill-schedule", json.dumps({str((1, 5)): ["1"]})]
    cmd = [sys.executable, "-m", "bps_tf.launch", "-np", "2", "--servers", "1",
           "--min-np", "1", "--timeout", str(timeout), sys.executable, worker] + args
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=work,
                          timeout=timeout + 60)
    if proc.returncode != 0:
        raise RuntimeError(f"bpslaunch exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    with open(times) as f:
        events = [json.loads(line) for line in f if line.strip()]
    kill = next(e["time"] for e in events if e["event"] == "kill")
    after = [e["time"] - kill for e in events
             if e["event"] == "step" and e["start_rank"] == 0 and e["time"] > kill]
    return min(after)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-tf", action="store_true")
    parser.add_argument("--no-baseline", action="store_true")
    args = parser.parse_args()
    cases = [("numpy workers, bpslaunch reports the loss", NUMPY_WORKER, {}, 120)]
    if not args.no_tf:
        cases.append(("TF workers (hvd.elastic.run, tf.function), bpslaunch reports",
                      TF_WORKER, {}, 300))
    if not args.no_baseline:
        cases.append(("numpy workers, heartbeats only (BYTEPS_TIMEOUT=30)", NUMPY_WORKER,
                      {"BYTEPS_LAUNCHER_REPORTS": "0", "BYTEPS_TIMEOUT": "30"}, 240))
    rows = []
    for name, worker, env, timeout in cases:
        seconds = []
        for _ in range(args.rounds):
            seconds.append(one_run(worker, env, timeout))
            print(f"  {name}: {seconds[-1]:.2f} s", flush=True)
        rows.append({"case": name, "seconds": seconds, "median": statistics.median(seconds)})
    print("\n| case | recovery after SIGKILL, median (all rounds) |\n|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['median']:.2f} s ({', '.join(f'{s:.2f}' for s in r['seconds'])}) |")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump({"time": time.time(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
