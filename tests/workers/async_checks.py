"""Worker script for test_async.py: asynchronous parameter-server training.

    bpslaunch -np 2 --servers 2 python tests/workers/async_checks.py OUT_DIR

The cluster starts WITHOUT BYTEPS_ENABLE_ASYNC (keys are asynchronous per
request). Phases, in order, on the examples' digits (examples/keras_digits.py):

0. "modes": rank 0 asks for mode="async", rank 1 for "sync": both refuse.
1. "strategy": BytePSStrategy(mode="async"), model.fit unchanged; evaluate,
   predict, save/load; then a barrier, one pull, and the weights are written
   to OUT_DIR/strategy.rank<r>.npz (they must agree across workers).
2. "hvd": BYTEPS_ENABLE_ASYNC=1 set in this process (what BytePS's switch
   selects on a worker), no strategy, bps_tf.keras.DistributedOptimizer with
   BroadcastGlobalVariablesCallback; a fit without the callback must refuse.
3. "throttle": mode="async" again; rank 1 sleeps in a callback (about 3x
   slower); rank 0 records its step times, finishes, evaluates and *exits*
   while rank 1 is still training: rank 1 must finish alone.
Results: OUT_DIR/rank<r>.json (check_record.Checks) plus per-phase details.
"""
import json
import logging
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["BYTEPS_ASYNC_LOG_STEPS"] = "20"
os.environ["BYTEPS_LOG_LEVEL"] = "INFO"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_record import Checks  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples"))
from digits_data import load_digits  # noqa: E402

import bps_tf  # noqa: E402
from bps_tf.comm import async_training  # noqa: E402
from bps_tf.strategy import BytePSStrategy  # noqa: E402

OUT = sys.argv[1]
BATCH = 32


def load_data():
    images, labels = load_digits()
    x = (images / 16.0).astype("float32")
    y = labels
    order = np.random.RandomState(0).permutation(len(x))
    x, y = x[order], y[order]
    split = len(x) * 4 // 5
    return (x[:split], y[:split]), (x[split:], y[split:])


def build_model():
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(10)])


def compile_model(model, optimizer):
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])


class StepTimes(keras.callbacks.Callback):
    """Step times; ``sleep`` after each step; ``wait_at``: at that step, wait
    for rank 0 to leave the job, then past the engine's grace for pending
    operations of a departed peer (3 s), then go on training alone."""

    def __init__(self, sleep=0.0, wait_at=None):
        super().__init__()
        self.sleep, self.wait_at, self.times, self._t = sleep, wait_at, [], None
        self.first_weights, self.waited = None, None

    def on_train_batch_begin(self, batch, logs=None):
        if self.first_weights is None:
            self.first_weights = [np.array(v) for v in self.model.trainable_variables]
        self._t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._t)
        if self.sleep:
            # At least twice this very step: on a loaded machine steps grow,
            # and a fixed sleep would stop making this worker 3x slower.
            time.sleep(max(self.sleep, 2.0 * self.times[-1]))
        if self.wait_at is not None and len(self.times) == self.wait_at:
            gone = os.path.join(OUT, "rank0.gone")
            deadline = time.time() + 60
            while not os.path.exists(gone) and time.time() < deadline:
                time.sleep(0.05)
            self.waited = os.path.exists(gone)
            time.sleep(3.5)


class LogLines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


(x_train, y_train), (x_test, y_test) = load_data()
log_lines = LogLines()
logging.getLogger("bps_tf").addHandler(log_lines)


def after_fit(model, name, rank):
    """evaluate / predict / save+load on this worker alone."""
    t0 = time.time()
    loss, acc = model.evaluate(x_test, y_test, batch_size=64, verbose=0)
    pred = model.predict(x_test, batch_size=64, verbose=0)
    path = os.path.join(OUT, f"{name}.rank{rank}.keras")
    model.save(path)
    reloaded = keras.models.load_model(path, compile=False)
    # The same batches as `pred`: another batch size changes the matmuls'
    # shapes, and so their rounding.
    same = float(np.max(np.abs(reloaded.predict(x_test, batch_size=64, verbose=0) - pred)))
    weights = max(float(np.max(np.abs(a - b)))
                  for a, b in zip(reloaded.get_weights(), model.get_weights()))
    return {"accuracy": float(acc), "pred_rows": int(pred.shape[0]),
            "pred_accuracy": float(np.mean(np.argmax(pred, 1) == y_test)),
            "reload_diff": same, "reload_weights_diff": weights, "seconds": time.time() - t0}


def final_pull(model, name, rank):
    """After every worker's fit: local vs pulled, then the pulled weights."""
    bps_tf.barrier(name=f"{name}_done")
    local = [np.array(v) for v in model.trainable_variables]
    async_training.pull(model.trainable_variables)
    pulled = [np.array(v) for v in model.trainable_variables]
    np.savez(os.path.join(OUT, f"{name}.rank{rank}.npz"), *pulled)
    return max(float(np.max(np.abs(a - b))) for a, b in zip(local, pulled))


def main():
    bps_tf.init()
    rank, size = bps_tf.rank(), bps_tf.size()
    checks = Checks(OUT, rank, size)
    detail = {}

    def refusal(name, call, error):
        """The message ``call`` is refused with ("" if it is not)."""
        try:
            call()
            refused = ""
        except error as exc:
            refused = str(exc)
        detail[name] = {"refused": refused}
        return refused

    # A sync worker would wait for gradients an async one never sends.
    checks.run("modes", lambda: refusal(
        "modes", lambda: BytePSStrategy(mode="async" if rank == 0 else "sync"), ValueError))

    def phase_missing():
        # A variable missing on one worker: the servers answer each worker
        # alone, so only the start's comparison of the lists can notice.
        variables = [tf.Variable(tf.zeros([3]), name="shared")]
        if rank == 1:
            variables.append(tf.Variable(tf.zeros([2]), name="only_on_rank1"))
        return refusal("missing", lambda: async_training.start_from_root(variables),
                       RuntimeError)

    checks.run("missing", phase_missing)
    strategy = BytePSStrategy(mode="async")
    keras.utils.set_random_seed(rank)    # different initial weights: rank 0's must win

    def phase_strategy():
        with strategy.scope():
            model = build_model()
            compile_model(model, keras.optimizers.Adam(2e-3))
        initial = [np.array(v) for v in model.trainable_variables]
        times = StepTimes()
        hist = model.fit(x_train, y_train, batch_size=BATCH, epochs=15, verbose=0,
                         callbacks=[times])
        d = after_fit(model, "strategy", rank)
        d["steps"] = len(times.times)
        d["median_step"] = float(np.median(times.times[5:]))
        d["epochs_run"] = len(hist.history["loss"])
        d["stats"] = async_training.stats()
        d["diff_before_pull"] = final_pull(model, "strategy", rank)
        np.savez(os.path.join(OUT, f"initial.rank{rank}.npz"), *initial)
        detail["strategy"] = d
        return d

    def phase_hvd():
        os.environ["BYTEPS_ENABLE_ASYNC"] = "1"
        from bps_tf.keras import DistributedOptimizer
        from bps_tf.keras.callbacks import BroadcastGlobalVariablesCallback
        xs, ys = x_train[rank::size], y_train[rank::size]
        keras.utils.set_random_seed(100 + rank)   # different initial weights
        # Without rank 0's start the store is empty: the first trace refuses.
        unstarted = build_model()
        compile_model(unstarted, DistributedOptimizer(keras.optimizers.Adam(2e-3)))
        try:
            unstarted.fit(xs[:BATCH], ys[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
            refused = ""
        except RuntimeError as exc:
            refused = str(exc)
        model = build_model()
        compile_model(model, DistributedOptimizer(keras.optimizers.Adam(2e-3)))
        initial = [np.array(v) for v in model.trainable_variables]
        times = StepTimes()
        model.fit(xs, ys, batch_size=BATCH, epochs=15, verbose=0,
                  callbacks=[BroadcastGlobalVariablesCallback(0), times])
        np.savez(os.path.join(OUT, f"hvd_initial.rank{rank}.npz"), *initial)
        np.savez(os.path.join(OUT, f"hvd_first.rank{rank}.npz"), *times.first_weights)
        loss, acc = model.evaluate(x_test, y_test, batch_size=64, verbose=0)
        d = {"refused": refused, "accuracy": float(acc), "stats": async_training.stats(),
             "steps": len(times.times),
             "diff_before_pull": final_pull(model, "hvd", rank)}
        os.environ["BYTEPS_ENABLE_ASYNC"] = "0"
        detail["hvd"] = d
        return d

    def phase_throttle():
        unthrottled = detail["strategy"]["median_step"]
        # At least 3x slower: a step plus at least twice its time asleep.
        sleep = max(2.0 * unthrottled, 0.02) if rank == 1 else 0.0
        with strategy.scope():
            model = build_model()
            compile_model(model, keras.optimizers.Adam(2e-3))
        times = StepTimes(sleep, wait_at=100 if rank == 1 else None)
        # Steps both workers made in the earlier phases (all finished then).
        before = detail["strategy"]["steps"] + detail["hvd"]["steps"]
        model.fit(x_train, y_train, batch_size=BATCH, epochs=6, verbose=0, callbacks=[times])
        end = async_training.stats()["pushes"]
        d = {"sleep": sleep, "steps": len(times.times),
             "median_step": float(np.median(times.times[5:])),
             "unthrottled_median_step": unthrottled,
             # each worker's steps in this fit, as the store counted them at
             # this worker's last step
             "steps_seen": [b - before for b in end], "waited_for_rank0": times.waited}
        d.update(after_fit(model, "throttle", rank))
        detail["throttle"] = d
        return d

    checks.run("strategy", phase_strategy)
    checks.run("hvd", phase_hvd)
    checks.run("throttle", phase_throttle)
    detail["log_lines"] = [line for line in log_lines.lines if "staleness" in line][-5:]
    with open(os.path.join(OUT, f"detail.rank{rank}.json"), "w") as f:
        json.dump(detail, f)
    if rank == 0:
        # Leave the job now (rank 1 is still training) and say so.
        bps_tf.shutdown()
        open(os.path.join(OUT, "rank0.gone"), "w").close()


if __name__ == "__main__":
    main()
