"""One worker of the time-to-accuracy benchmark: `model.fit` of an MLP on a
learnable synthetic task under BytePSStrategy(compression=...).

Usage: compression_fit.py SPEC.json (DMLC_* set: it joins a bps_tf cluster).
Every worker evaluates the model on the same held-out set every
`eval_every` steps (locally, no collective) and records the training time
so far, evaluation excluded. Writes OUT_DIR/worker<rank>.json.

spec: compression (a name of COMPRESSORS), steps, eval_every,
batch_per_worker, features, hidden, classes, lr, threads, out_dir.
"""
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf


def compressor(name):
    from bps_tf import Compression
    return {
        "none": Compression.none,
        "fp16": Compression.fp16,
        "onebit+ef": Compression.onebit(scaling=True, error_feedback=True),
        "topk1%+ef": Compression.topk(0.01, error_feedback=True),
        "randomk10%+ef": Compression.randomk(0.1, seed=1, error_feedback=True),
        "dithering8": Compression.dithering(8, seed=1),
    }[name]


def teacher_data(features, classes, count, seed):
    """Labels from a fixed random linear teacher: learnable, never perfectly
    by a few steps of SGD."""
    teacher = np.random.default_rng(1234).standard_normal((features, classes)).astype(np.float32)
    x = np.random.default_rng(seed).standard_normal((count, features)).astype(np.float32)
    return x, np.argmax(x @ teacher, axis=1).astype(np.int64)


def main():
    spec = json.load(open(sys.argv[1]))
    tf.config.threading.set_intra_op_parallelism_threads(spec["threads"])
    tf.config.threading.set_inter_op_parallelism_threads(max(2, spec["threads"]))
    import keras
    import bps_tf
    from bps_tf.runtime import basics

    strategy = bps_tf.BytePSStrategy(compression=compressor(spec["compression"]))
    rank, workers = bps_tf.rank(), bps_tf.size()
    keras.utils.set_random_seed(0)
    global_batch = spec["batch_per_worker"] * workers
    features, classes = spec["features"], spec["classes"]
    x, y = teacher_data(features, classes, global_batch * 64, seed=0)   # 64 steps an epoch
    x_val, y_val = teacher_data(features, classes, 4096, seed=1)
    epochs = -(-spec["steps"] // 64)

    with strategy.scope():
        layers = [keras.Input((features,))]
        for width in spec["hidden"]:
            layers.append(keras.layers.Dense(width, activation="relu"))
        layers.append(keras.layers.Dense(classes))
        model = keras.Sequential(layers)
        model.compile(optimizer=keras.optimizers.SGD(spec["lr"]),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)

    class Curve(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.points, self.eval_s, self.step = [], 0.0, 0

        def on_train_begin(self, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.step += 1
            if self.step % spec["eval_every"] and self.step != spec["steps"]:
                return
            begin = time.perf_counter()
            logits = self.model(x_val, training=False)
            acc = float(np.mean(np.argmax(logits.numpy(), axis=1) == y_val))
            self.points.append([self.step, begin - self.start - self.eval_s, acc])
            self.eval_s += time.perf_counter() - begin
            if self.step >= spec["steps"]:
                self.model.stop_training = True

    curve = Curve()
    before = basics.stats()
    model.fit(x, y, batch_size=global_batch, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[curve])
    after = basics.stats()
    steps = curve.step
    result = {"rank": rank, "workers": workers, "compression": spec["compression"],
              "params": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
              "steps": steps, "curve": curve.points,
              "bytes_sent_per_step": (after["bytes_sent"] - before["bytes_sent"]) / steps,
              "bytes_received_per_step":
                  (after["bytes_received"] - before["bytes_received"]) / steps}
    out = os.path.join(spec["out_dir"], f"worker{rank}.json")
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main()
