"""Weights written between steps under BytePSStrategy overlap (imported by
overlap_fit_checks.py, run in its cluster).

Under overlap, step k's update is still pending when a callback runs after
step k; a write there must land *after* that update, as under the barrier,
not be overwritten by it. Each case trains the same model with
overlap=False and overlap=True, with a callback (or a step between fits)
that writes the weights, and returns both final weights for a bit-for-bit
comparison.
"""
import os
import tempfile

import numpy as np
import tensorflow as tf
import keras

GLOBAL_BATCH, ROWS, FEATURES = 16, 128, 6    # 8 steps per epoch
_scratch = {"dir": None}   # the test's folder for the files the cases write (check_writes)


def _scratch_dir(prefix):
    return tempfile.mkdtemp(prefix=prefix, dir=_scratch["dir"])


def _model():
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(12, activation="tanh"),
                             keras.layers.Dense(2)])


def _data():
    rng = np.random.default_rng(11)
    return (rng.standard_normal((ROWS, FEATURES)).astype("float32"),
            rng.standard_normal((ROWS, 2)).astype("float32"))


class SetWeights(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch % 3 == 1:
            self.model.set_weights([w * 0.9 for w in self.model.get_weights()])


class Assign(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch % 2 == 0:
            kernel = self.model.layers[0].kernel
            kernel.assign(tf.clip_by_value(kernel, -0.2, 0.2))


class LoadWeights(keras.callbacks.Callback):
    """Saves the weights at batch 2 and loads them back at batch 5."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            self.model.save_weights(self.path)
        elif batch == 5:
            self.model.load_weights(self.path)


class Lookahead(keras.callbacks.Callback):
    """Lookahead: every k batches the slow weights move toward the fast ones
    and the fast weights are reset to them (assigns between steps)."""

    def __init__(self, k=3, alpha=0.5):
        super().__init__()
        self.k, self.alpha, self.slow = k, alpha, None

    def on_train_begin(self, logs=None):
        self.slow = [np.array(v) for v in self.model.trainable_variables]

    def on_train_batch_end(self, batch, logs=None):
        if (batch + 1) % self.k:
            return
        for i, v in enumerate(self.model.trainable_variables):
            self.slow[i] = self.slow[i] + self.alpha * (np.array(v) - self.slow[i])
            v.assign(self.slow[i])


def _fit(strategy, callbacks, epochs=2, optimizer=lambda: keras.optimizers.Adam(0.02),
         model=None):
    x, y = _data()
    if model is None:
        keras.utils.set_random_seed(3)
        with strategy.scope():
            model = _model()
            model.compile(optimizer=optimizer(), loss="mse")
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=callbacks)
    return model


def _early_stopping(strategy):
    # A learning rate that makes the loss go up after the first epochs, so
    # the best weights are not the last ones and are restored at the end.
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=2,
                                         restore_best_weights=True)
    return _fit(strategy, [stop], epochs=5, optimizer=lambda: keras.optimizers.SGD(0.9))


def _swap_ema(strategy):
    return _fit(strategy, [keras.callbacks.SwapEMAWeights(swap_on_epoch=True)],
                optimizer=lambda: keras.optimizers.Adam(0.02, use_ema=True))


def _checkpoint_between_fits(strategy):
    model = _fit(strategy, [], epochs=1)
    checkpoint = tf.train.Checkpoint(model=model)
    path = checkpoint.save(os.path.join(_scratch_dir("bps_overlap_ckpt_"), "c"))
    _fit(strategy, [], epochs=1, model=model)          # pending updates, then...
    checkpoint.restore(path).assert_existing_objects_matched()   # ...a restore
    return _fit(strategy, [], epochs=1, model=model)


CASES = {
    "set_weights": lambda s: _fit(s, [SetWeights()]),
    "assign": lambda s: _fit(s, [Assign()]),
    "load_weights": lambda s: _fit(s, [LoadWeights(os.path.join(
        _scratch_dir("bps_overlap_w_"), "mid.weights.h5"))]),
    "lookahead": lambda s: _fit(s, [Lookahead()]),
    "early_stopping_restore": _early_stopping,
    "swap_ema": _swap_ema,
    "checkpoint_restore": _checkpoint_between_fits,
}


def check_writes(off, on, scratch):
    """{case: {"same": bool, "max_diff": float}} for every write case; the
    files they write go under `scratch` (the test's folder, removed with it)."""
    _scratch["dir"] = scratch

    def run():
        out = {}
        for name, case in CASES.items():
            want = case(off).get_weights()
            got = case(on).get_weights()
            diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want))
            out[name] = {"same": all(np.array_equal(a, b) for a, b in zip(got, want)),
                         "max_diff": diff}
        return out
    return run
