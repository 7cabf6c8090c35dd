"""An elastic training loop on the numpy path (no TensorFlow), run by
tests/test_elastic_servers.py while the test loses, adds and replaces
servers and the scheduler under it.

Each step every worker pushes a gradient that depends on its rank, the step
and the weights; the weights move by the average. Every COMMIT steps the
worker commits (weights, step) and checks for host updates (a server that
joins or leaves: restart keeping the state). A membership change rolls back
to the commit and restarts the membership. The loop ends at the first step
at which every worker has seen OUT/finish.

Writes OUT/progress_r<rank>.json (step, epoch, size) as it goes and
OUT/done_r<rank>.json at the end: the final step, the weights, and the
events (restarts with their kind, the steps redone).
"""
import json
import os
import sys
import time

import numpy as np

from bps_tf.runtime import basics, elastic_core

OUT = sys.argv[1]
COMMIT = 5
N = 16384          # float32: 64 KiB, several partitions on every server
PAUSE_S = float(os.environ.get("STEP_PAUSE_S", "0.05"))


def push_pull(name, array):
    out = np.empty_like(array)
    basics.core().push_pull_async(name, array, out, 0).wait(60)
    return out


def write(name, data):
    tmp = os.path.join(OUT, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, os.path.join(OUT, name + ".json"))


def gradient(w, rank, step):
    return (w * np.float32(0.01) + np.float32((rank + 1) * (step % 7 + 1))).astype(np.float32)


basics.join()
w = np.zeros(N, np.float32)
step = 0
committed = (w.copy(), step)
events = []
trained = []         # every step trained, in order (a redone step appears twice)
launch = os.environ.get("DMLC_WORKER_ID", "?")
while True:
    try:
        rank, size = basics.rank(), basics.size()
        write(f"progress_{launch}", {"step": step, "epoch": elastic_core.epoch(), "size": size,
                                     "rank": rank, "time": time.time()})
        total = push_pull("grad", gradient(w, rank, step))
        want = sum(gradient(w, r, step) for r in range(size))
        if not np.array_equal(total, want):
            raise AssertionError(f"step {step}: the sum differs from the workers' gradients")
        w = w - np.float32(0.001) * (total / np.float32(size))
        trained.append(step)
        step += 1
        if step % COMMIT == 0:
            committed = (w.copy(), step)
            waiting = push_pull("updates", np.array([elastic_core.workers_waiting()], np.int32))
            if waiting[0] > 0:
                events.append({"kind": "updates", "step": step, "time": time.time()})
                elastic_core.restart()
                continue
            done = push_pull("finish", np.array([os.path.exists(os.path.join(OUT, "finish"))],
                                                np.int32))
            if done[0] == size:
                break
        time.sleep(PAUSE_S)
    except RuntimeError as exc:
        if not elastic_core.changed():
            raise
        events.append({"kind": "changed", "step": step, "back_to": committed[1],
                       "why": " ".join(str(exc).split())[:300], "time": time.time()})
        w, step = committed[0].copy(), committed[1]
        elastic_core.restart()
write(f"done_{launch}", {"rank": basics.rank(), "size": basics.size(), "step": step,
                         "epoch": elastic_core.epoch(), "w": w.tolist()[:8],
                         "w_sum": float(w.astype(np.float64).sum()), "events": events,
                         "trained": trained})
np.save(os.path.join(OUT, f"w_{launch}.npy"), w)
basics.shutdown()
