"""A slow worker must not slow a fast one in asynchronous training.

    python benchmarks/async_throttle.py [--steps 60] [--rounds 3]

Runs 2 workers x 1 server on loopback (one TF thread each), twice: with
BytePSStrategy(mode="async") and, for comparison, mode="sync". In each job
the same model is fitted 2 x ROUNDS times, alternating: rank 1 unthrottled,
then rank 1 throttled (after every step it spins for twice its own median
step time: about 3x slower; spinning rather than sleeping keeps its CPU use,
so on a machine with fewer cores than processes the fast worker does not
speed up from the core a sleeping worker would free). Reported: rank 0's median step time in each state
and the ratio throttled / unthrottled (async should stay within 10 %; sync
waits for the slow worker at every step). Results: benchmarks/results/async_throttle.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.common import PYTHON, WORKERS_DIR, median  # noqa: E402

SCRIPT = str(WORKERS_DIR / "async_throttle.py")


def _env() -> dict:
    # The installed bps_tf (not the source tree), and no placement variables
    # from the caller's shell.
    env = {k: v for k, v in os.environ.items() if k not in common.PLACEMENT_VARIABLES}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def run(mode: str, steps: int, rounds: int) -> dict:
    out = tempfile.mkdtemp(prefix=f"bps_async_throttle_{mode}_")
    cmd = [PYTHON, "-m", "bps_tf.launch", "-np", "2", "--servers", "1", "--timeout", "500",
           PYTHON, SCRIPT, out, mode, str(steps), str(rounds)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=560,
                          cwd=tempfile.gettempdir(), env=_env())
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} job failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    with open(os.path.join(out, "worker0.json")) as f:
        fast = json.load(f)["phases"]
    with open(os.path.join(out, "worker1.json")) as f:
        slow = json.load(f)["phases"]
    free = [p["median_step"] for p in fast if not p["throttled"]]
    held = [p["median_step"] for p in fast if p["throttled"]]
    slow_free = [p["wall_per_step"] for p in slow if not p["throttled"]]
    slow_held = [p["wall_per_step"] for p in slow if p["throttled"]]
    return {"mode": mode, "fast_unthrottled_ms": 1e3 * median(free),
            "fast_beside_throttled_ms": 1e3 * median(held),
            "ratio": median(held) / median(free),
            "slow_slowdown": median(slow_held) / median(slow_free),
            "phases_rank0": fast, "phases_rank1": slow}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results = [run(mode, args.steps, args.rounds) for mode in ("async", "sync")]
    common.print_table(
        "rank 0's median step time while rank 1 is throttled ~3x",
        ["mode", "rank 0 alone-speed (ms)", "rank 0 beside throttled (ms)", "ratio",
         "rank 1 slowdown"],
        [[r["mode"], f"{r['fast_unthrottled_ms']:.2f}", f"{r['fast_beside_throttled_ms']:.2f}",
          f"{r['ratio']:.3f}", f"{r['slow_slowdown']:.2f}x"] for r in results])
    path = common.write_json("async_throttle", {"environment": common.environment_summary(),
                                                "args": vars(args), "results": results})
    print(f"results: {path}")


if __name__ == "__main__":
    common.run_main(main)
