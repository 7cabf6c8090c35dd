"""An elastic training loop on the numpy path (no TensorFlow), run by
tests/test_elastic_servers.py while the test loses, adds and replaces
servers and the scheduler under it, and sends SIGTERM to a server and to a
worker.

Horovod's elastic loop without TensorFlow (bps_tf.runtime.elastic_state.run):
each step every worker pushes a gradient that depends on its rank, the step
and the weights, and the weights move by the average; every COMMIT steps the
state (weights, step) is committed, which also checks the host updates (a
server or worker that joins or leaves: restart keeping the state). A
membership change rolls back to the commit. The loop ends at the first
commit at which every worker has seen OUT/finish.

Writes OUT/progress_<launch>.json as it goes and, at the end,
OUT/done_<launch>.json (the final step, every step trained with its size,
the restarts: "changed" after a rollback, "updates" without one) and
OUT/w_<launch>.npy. A worker that leaves on SIGTERM writes its done file
when its state is committed for the last time (it exits 0 in the reset).
OUT/slow_<launch> delays that worker's next membership restart.
"""
import json
import os
import sys
import time

import numpy as np

from bps_tf.runtime import basics, elastic_core, elastic_state

OUT = sys.argv[1]
COMMIT = 5
N = 16384          # float32: 64 KiB, several partitions on every server
PAUSE_S = float(os.environ.get("STEP_PAUSE_S", "0.05"))
LAUNCH = os.environ.get("BYTEPS_LAUNCH_ID") or os.environ.get("DMLC_WORKER_ID", "?")


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


class Weights(elastic_state.ObjectState):
    def __init__(self):
        self.w = np.zeros(N, np.float32)
        self._w = self.w.copy()
        self.events = []
        self.trained = []        # (step, size) in the order trained: a redone step comes again
        self._rolled_back = None
        super().__init__(step=0)
        self.register_reset_callbacks([self._note_reset])

    def save(self):
        self._w = self.w.copy()
        super().save()

    def restore(self):
        self._rolled_back = (self.step, self._saved_state["step"])
        self.w = self._w.copy()
        super().restore()

    def sync(self):
        self._w = elastic_state.broadcast_object(self._w, name="test.elastic/w")
        self.w = self._w.copy()
        super().sync()

    def _note_reset(self):
        event = {"kind": "updates", "step": self.step, "time": time.time()}
        if self._rolled_back is not None:
            event.update(kind="changed", step=self._rolled_back[0], back_to=self._rolled_back[1])
        self._rolled_back = None
        self.events.append(event)

    def record(self, name):
        write(name, {"rank": basics.rank(), "size": basics.size(), "step": self.step,
                     "epoch": elastic_core.epoch(), "events": self.events,
                     "trained": self.trained})
        np.save(os.path.join(OUT, f"w_{LAUNCH}.npy"), self.w)


def restart_membership():
    """The membership restart, late when the test asks for it (OUT/slow_<launch>
    holds the seconds): the core keeps sending heartbeats meanwhile, as a worker
    slowed down by a loaded machine or a long step does."""
    slow = os.path.join(OUT, f"slow_{LAUNCH}")
    if os.path.exists(slow):
        with open(slow) as f:
            seconds = float(f.read())
        os.remove(slow)
        time.sleep(seconds)
    elastic_state.reset_membership()


def train(state):
    while True:
        rank, size = basics.rank(), basics.size()
        write(f"progress_{LAUNCH}", {"step": state.step, "epoch": elastic_core.epoch(),
                                     "size": size, "rank": rank, "time": time.time()})
        total = push_pull("grad", gradient(state.w, rank, state.step))
        want = sum(gradient(state.w, r, state.step) for r in range(size))
        if not np.array_equal(total, want):
            raise AssertionError(f"step {state.step}: the sum differs from the workers' gradients")
        state.w = state.w - np.float32(0.001) * (total / np.float32(size))
        state.trained.append((state.step, size))
        state.step += 1
        if state.step % COMMIT == 0:
            if elastic_core.leaving():
                state.record(f"done_{LAUNCH}")   # it leaves at this commit
            state.commit()
            done = push_pull("finish", np.array([os.path.exists(os.path.join(OUT, "finish"))],
                                                np.int32))
            if done[0] == size:
                return
        time.sleep(PAUSE_S)


basics.join()
weights = Weights()
elastic_state.run_fn(train, restart_membership)(weights)
weights.record(f"done_{LAUNCH}")
basics.shutdown()
