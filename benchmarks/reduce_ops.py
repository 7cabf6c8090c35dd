"""Min/Max/Product on the servers against the allgather path they replaced.

    python benchmarks/reduce_ops.py [--workers 2] [--servers 1] [--sizes 1,16] [--reps 10]

Eager ``allreduce`` of float32 tensors on loopback; median seconds per call
of Sum, Max and Product (servers) and of Max computed from an allgather
(what bps_tf did before: every worker receives every worker's tensor), all
measured in the same job. Writes benchmarks/results/reduce_ops.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--sizes", default="1,16", help="MiB, comma-separated")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    cmd = [sys.executable, "-m", "bps_tf.launch", "-np", str(args.workers), "--servers",
           str(args.servers), "--timeout", "600", sys.executable,
           str(ROOT / "benchmarks" / "workers" / "reduce_ops_worker.py"), args.sizes,
           str(args.reps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=660,
                          cwd=tempfile.gettempdir())
    lines = [ln for ln in proc.stdout.splitlines() if "RESULT " in ln]
    if proc.returncode != 0 or not lines:
        sys.exit(f"job failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    rows = json.loads(lines[-1].split("RESULT ", 1)[1])
    print(f"{args.workers} workers x {args.servers} servers, eager, median of {args.reps} calls (s)")
    print(f"{'MiB':>6} {'sum':>8} {'max':>8} {'product':>8} {'max by allgather':>17}")
    for r in rows:
        print(f"{r['MiB']:>6g} {r['sum']:>8.4f} {r['max']:>8.4f} {r['product']:>8.4f} "
              f"{r['max_by_allgather']:>17.4f}")
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "reduce_ops.json"), "w") as f:
        json.dump({"workers": args.workers, "servers": args.servers, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
