"""Worker of benchmarks/async_throttle.py: step times of rank 0 while rank 1
is, by turns, unthrottled and throttled (busy for twice its own median step
after each step: about 3x slower).

    bpslaunch -np 2 --servers 1 python benchmarks/workers/async_throttle.py OUT MODE STEPS ROUNDS
"""
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

# One core per worker: a worker that sleeps must not lend its core to the
# other (that would speed the fast one up, not measure waiting).
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import bps_tf  # noqa: E402
from bps_tf.strategy import BytePSStrategy  # noqa: E402

OUT, MODE, STEPS, ROUNDS = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
BATCH, FEATURES, HIDDEN = 64, 256, 512


class Steps(keras.callbacks.Callback):
    def __init__(self, sleep):
        super().__init__()
        self.sleep, self.times = sleep, []

    def on_train_batch_begin(self, batch, logs=None):
        self._t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._t)
        if self.sleep:
            # Spin, not sleep: the throttled worker keeps its core busy as a
            # slow step would, so the fast one gains no CPU from it on a
            # machine with fewer cores than processes.
            end = time.perf_counter() + self.sleep
            while time.perf_counter() < end:
                pass


def main():
    strategy = BytePSStrategy(mode=MODE)
    rank, size = bps_tf.rank(), bps_tf.size()
    rng = np.random.RandomState(rank)
    # STEPS steps per epoch on each worker: sync mode splits a global batch
    # of BATCH x size, async mode gives each worker every size-th row.
    rows = STEPS * BATCH * size
    x = rng.randn(rows, FEATURES).astype("float32")
    y = rng.randint(0, 10, rows)
    batch = BATCH * size if MODE == "sync" else BATCH
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)),
                                  keras.layers.Dense(HIDDEN, activation="relu"),
                                  keras.layers.Dense(HIDDEN, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    phases, own = [], None
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)   # trace and warm up
    for r in range(ROUNDS):
        for throttled in (False, True):
            sleep = 2.0 * own if (throttled and rank == 1) else 0.0
            steps = Steps(sleep)
            model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[steps])
            median = float(np.median(steps.times[3:]))
            if not throttled and own is None:
                own = median
            phases.append({"round": r, "throttled": throttled, "sleep": sleep,
                           "steps": len(steps.times), "median_step": median,
                           "wall_per_step": float(np.sum(steps.times) + sleep * len(steps.times))
                           / len(steps.times)})
    with open(os.path.join(OUT, f"worker{rank}.json"), "w") as f:
        json.dump({"rank": rank, "mode": MODE, "phases": phases}, f)


if __name__ == "__main__":
    main()
