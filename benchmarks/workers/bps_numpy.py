"""bps_tf worker without TensorFlow: times push_pulls of numpy arrays.

Usage: bps_numpy.py SPEC.json (see benchmarks/README.md for the spec). For
each case, every repetition enqueues all of the case's tensors at once and
waits for all of them; start and end times (perf_counter) are recorded per
repetition and written to OUT_DIR/worker<rank>.json.
"""
import json
import os
import sys
import time

import numpy as np

import bps_tf  # noqa: E402
from bps_tf.runtime import basics


def run_case(core, rank, size, case, wait_s):
    arrays = []
    for name, shape, priority in case["tensors"]:
        a = np.full(shape, float(rank + 1), dtype=np.float32)
        arrays.append((f"{case['label']}/{name}", a, np.empty_like(a), int(priority)))
    starts, ends = [], []
    fresh = case.get("fresh_output", False)
    for k in range(case["warmup"] + case["reps"]):
        t0 = time.perf_counter()
        if fresh:
            # A new output buffer per repetition, as TensorFlow allocates an
            # op's output every step: its pages are first touched by the copy.
            arrays = [(n, a, np.empty_like(a), p) for n, a, _, p in arrays]
        handles = [core.push_pull_async(n, a, o, p, "") for n, a, o, p in arrays]
        for h in handles:
            h.wait(wait_s)
        t1 = time.perf_counter()
        if k + 1 == case["warmup"] and case.get("warm_file"):
            # A profiler may start now (benchmarks/profile_push_pull.py).
            open(case["warm_file"].format(rank=rank), "w").close()
        if k >= case["warmup"]:
            starts.append(t0)
            ends.append(t1)
    expect = size * (size + 1) / 2
    correct = all(o.size == 0 or (o.flat[0] == expect and o.flat[-1] == expect)
                  for _, _, o, _ in arrays)
    return {"label": case["label"], "starts": starts, "ends": ends, "correct": bool(correct),
            "bytes": int(sum(a.nbytes for _, a, _, _ in arrays))}


def main():
    spec = json.load(open(sys.argv[1]))
    bps_tf.init()
    core, rank, size = basics.core(), basics.rank(), basics.size()
    results = [run_case(core, rank, size, case, spec.get("wait_s", 300.0))
               for case in spec["cases"]]
    stats = basics.stats()
    stats.pop("send_log", None)
    out = os.path.join(spec["out_dir"], f"worker{rank}.json")
    with open(out + ".tmp", "w") as f:
        json.dump({"rank": rank, "size": size, "cases": results, "stats": stats}, f)
    os.replace(out + ".tmp", out)
    basics.shutdown()


if __name__ == "__main__":
    main()
