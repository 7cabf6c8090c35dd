"""Worker of benchmarks/small_fit_step.py: times the steps of an unchanged
model.fit under BytePSStrategy on a tiny dense model (almost no compute, 6
small gradients per step), so a step's time is the engine's latency.

    python small_fit.py SPEC.json OUT_DIR     (one per worker, run_bps_job)
"""
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import keras  # noqa: E402

import bps_tf  # noqa: E402


def main():
    spec = json.load(open(sys.argv[1]))
    out_dir = sys.argv[2]
    bps_tf.init()
    strategy = bps_tf.BytePSStrategy(overlap=bool(spec["overlap"]))
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    rng = np.random.default_rng(0)
    rows = spec["batch"] * spec["steps"]
    x = rng.standard_normal((rows, 8)).astype("float32")
    y = rng.standard_normal((rows, 3)).astype("float32")
    model.fit(x, y, batch_size=spec["batch"], epochs=1, verbose=0)     # traces, warms up
    start = time.perf_counter()
    model.fit(x, y, batch_size=spec["batch"], epochs=spec["epochs"], verbose=0)
    seconds = time.perf_counter() - start
    with open(os.path.join(out_dir, f"worker{bps_tf.rank()}.json"), "w") as f:
        json.dump({"step_s": seconds / (spec["epochs"] * spec["steps"])}, f)
    bps_tf.shutdown()


if __name__ == "__main__":
    main()
