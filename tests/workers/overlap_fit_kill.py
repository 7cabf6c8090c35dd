"""Worker for test_overlap_fit.py's killed-server test: model.fit under
BytePSStrategy(overlap=True) pauses after batch 2 (its push_pulls started and
not yet applied), writes OUT/ready<r> with the keys pending, and waits for
OUT/killed; the test kills a server meanwhile. The error fit then raises is
written to OUT/error<r>.json and the process exits 2 (0 would mean fit ended
normally).

    python overlap_fit_kill.py OUT_DIR       (one per worker, ManualCluster)
"""
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import keras  # noqa: E402

import bps_tf  # noqa: E402
from bps_tf.overlap import fit as overlap_fit  # noqa: E402
from bps_tf.strategy import BytePSStrategy  # noqa: E402

OUT = sys.argv[1]


class Pause(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch != 2:
            return
        pending = overlap_fit.controller(self.model).pending()
        with open(os.path.join(OUT, f"ready{bps_tf.rank()}"), "w") as f:
            json.dump(pending, f)
        deadline = time.time() + 60
        while not os.path.exists(os.path.join(OUT, "killed")) and time.time() < deadline:
            time.sleep(0.05)


def main():
    strategy = BytePSStrategy(overlap=True)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((640, 8)).astype("float32")
    y = rng.standard_normal((640, 3)).astype("float32")
    started = time.time()
    try:
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[Pause()])
    except Exception as exc:  # recorded for the test
        with open(os.path.join(OUT, f"error{bps_tf.rank()}.json"), "w") as f:
            json.dump({"type": type(exc).__name__, "message": str(exc)[-2000:],
                       "seconds": time.time() - started}, f)
        os._exit(2)


if __name__ == "__main__":
    main()
