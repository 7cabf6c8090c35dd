"""Worker of benchmarks/fingerprint_cost.py: the step of model.fit under
BytePSStrategy on a 669,706-parameter MLP with the replica fingerprint off,
and the time of one fingerprint check of the model (its weights and Adam's
slots), taken as fit takes it (one traced function) and, as the baseline in
the same run, the eager way (a few ops per variable) it was taken before.

    python fingerprint_cost.py SPEC.json OUT_DIR     (one per worker, run_bps_job)
"""
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["BYTEPS_FINGERPRINT_STEPS"] = "0"      # fit's own checks off: timed alone below

import numpy as np  # noqa: E402
import keras  # noqa: E402

import bps_tf  # noqa: E402
from bps_tf.comm import fingerprint, naming  # noqa: E402
from bps_tf.strategy import drift_check  # noqa: E402


def timed(fn, repeats):
    fn()                                           # traces, warms up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main():
    spec = json.load(open(sys.argv[1]))
    out_dir = sys.argv[2]
    bps_tf.init()
    strategy = bps_tf.BytePSStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(bps_tf.rank())
    rows = spec["batch"] * spec["steps"]
    x = rng.standard_normal((rows, 784)).astype("float32")
    y = rng.integers(0, 10, rows)
    model.fit(x, y, batch_size=spec["batch"], epochs=1, verbose=0)     # traces, warms up
    start = time.perf_counter()
    model.fit(x, y, batch_size=spec["batch"], epochs=spec["epochs"], verbose=0)
    step = (time.perf_counter() - start) / (spec["epochs"] * spec["steps"])
    variables = drift_check.checked_variables(model)
    key = naming.strategy_key("bench", "fingerprint_eager")
    check = timed(lambda: drift_check.check(model, "benchmark"), spec["checks"])
    eager = timed(lambda: fingerprint.check_now(variables, key, "benchmark"), spec["checks"])
    with open(os.path.join(out_dir, f"worker{bps_tf.rank()}.json"), "w") as f:
        json.dump({"step_s": step, "check_s": check, "check_eager_s": eager,
                   "parameters": int(model.count_params()), "variables": len(variables)}, f)
    bps_tf.shutdown()


if __name__ == "__main__":
    main()
