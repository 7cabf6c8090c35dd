"""Worker script for test_overlap_fit.py: BytePSStrategy(overlap=True) under model.fit.

    bpslaunch -np 2 --servers 2 python tests/workers/overlap_fit_checks.py OUT_DIR

Every worker runs the same checks in the same order; each trains the same
model twice with unchanged ``model.fit`` -- under BytePSStrategy(overlap=False)
(the reference) and overlap=True -- on the same data, and compares weights,
optimizer variables, iterations, history and weights read by a callback
mid-training bit for bit (and, in FLUSH_CHECKED's cases, validation,
evaluate/predict results and a ModelCheckpoint file).
Results go to OUT_DIR/rank<r>.json (tests/workers/check_record.py).
"""
import logging
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import bps_tf  # noqa: E402
from bps_tf.comm import collectives  # noqa: E402
from bps_tf.overlap import fit as overlap_fit  # noqa: E402
from bps_tf.strategy import BytePSStrategy  # noqa: E402
from check_record import Checks  # noqa: E402
from overlap_write_checks import check_writes  # noqa: E402

GLOBAL_BATCH, ROWS, FEATURES, VOCAB = 32, 256, 8, 30   # 8 steps per epoch
EPOCHS = 2


class Marker(keras.layers.Layer):
    """Identity that ends a debug hold once the layer before it has run."""

    def call(self, x):
        return collectives.debug_marker(x)


def dense_model(bn=False):
    layers = [keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"), Marker()]
    if bn:
        layers.append(keras.layers.BatchNormalization())
    layers += [keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)]
    return keras.Sequential(layers)


def embedding_model():
    tokens = keras.Input((4,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 6)(tokens)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    return keras.Model(tokens, keras.layers.Dense(3)(x))


class OwnTrainStep(keras.Model):
    """A model with its own train_step (here Keras' own, but overlap cannot
    know what an override reads)."""

    def train_step(self, data):
        return super().train_step(data)


def own_train_step_model():
    inputs = keras.Input((FEATURES,))
    x = keras.layers.Dense(16, activation="relu")(inputs)
    return OwnTrainStep(inputs, keras.layers.Dense(3)(x))


class TiedOutput(keras.layers.Layer):
    """Reads another layer's kernel (weight tying)."""

    def __init__(self, source, **kwargs):
        super().__init__(**kwargs)
        self.source = source

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.source.kernel))


def tied_model():
    inputs = keras.Input((3,))
    first = keras.layers.Dense(16, activation="tanh")
    return keras.Model(inputs, TiedOutput(first)(first(inputs)))


class ReadsLater(keras.layers.Layer):
    """Adds a term of a later layer's kernel: read before that layer's own
    forward, where its deferred update has not been applied yet. The kernel
    comes through a function, so Keras does not count it as this layer's."""

    def __init__(self, kernel_of, **kwargs):
        super().__init__(**kwargs)
        self.kernel_of = kernel_of

    def call(self, x):
        return x + 0.1 * keras.ops.mean(self.kernel_of())


def reads_later_model():
    inputs = keras.Input((FEATURES,))
    last = keras.layers.Dense(3)
    last.build((None, 16))
    x = keras.layers.Dense(16, activation="relu")(inputs)
    x = ReadsLater(lambda: last.kernel)(x)
    return keras.Model(inputs, last(x))


class GraphProbe(keras.callbacks.Callback):
    """Reads the weights every batch inside a tf.function (not through Keras)."""

    def __init__(self):
        super().__init__()
        self.sums, self._read = [], None

    def on_train_batch_end(self, batch, logs=None):
        if self._read is None:
            weights = self.model.trainable_variables
            self._read = tf.function(lambda: tf.add_n([tf.reduce_sum(w) for w in weights]))
        self.sums.append(float(self._read()))


CASES = {
    "sgd": (dense_model, lambda: keras.optimizers.SGD(0.05), 1),
    "adam": (dense_model, lambda: keras.optimizers.Adam(0.01), 1),
    "adamw_schedule_spe3": (dense_model, lambda: keras.optimizers.AdamW(
        keras.optimizers.schedules.ExponentialDecay(0.01, 3, 0.5), weight_decay=0.05,
        clipnorm=1.0), 3),
    "momentum_bn": (lambda: dense_model(bn=True),
                    lambda: keras.optimizers.SGD(0.05, momentum=0.9), 1),
    "rmsprop_bn_spe2": (lambda: dense_model(bn=True), lambda: keras.optimizers.RMSprop(
        0.01, momentum=0.5, centered=True), 2),
    "adafactor": (dense_model, lambda: keras.optimizers.Adafactor(0.01), 1),
    "nadam_fallback": (dense_model, lambda: keras.optimizers.Nadam(0.01), 1),
    "global_clipnorm": (dense_model, lambda: keras.optimizers.SGD(
        0.05, momentum=0.5, global_clipnorm=0.5), 2),
    "embedding_adam": (embedding_model, lambda: keras.optimizers.Adam(0.01), 1),
    "ema_fallback": (dense_model, lambda: keras.optimizers.Adam(0.01, use_ema=True), 1),
    "train_step_fallback": (own_train_step_model, lambda: keras.optimizers.SGD(0.05), 1),
    "tied_fallback": (tied_model, lambda: keras.optimizers.SGD(0.05), 1),
    "reads_later_fallback": (reads_later_model, lambda: keras.optimizers.SGD(0.05), 1),
    "graph_probe": (dense_model, lambda: keras.optimizers.Adam(0.01), 1),
}


# Cases that also check what overlap must flush for besides the update: the
# validation at each epoch's end, evaluate() and predict() after fit, a
# mid-epoch ModelCheckpoint file. Those flushes do not depend on the
# optimizer: a plain, a batch-normalized (moving statistics), a
# steps_per_execution and a graph-reading case cover them, and the other
# optimizers' cases check the training itself, which is what differs.
FLUSH_CHECKED = ("sgd", "momentum_bn", "rmsprop_bn_spe2", "graph_probe")


def data(case):
    rng = np.random.default_rng(5)
    if case.startswith("embedding"):
        x = rng.integers(0, VOCAB, (ROWS, 4)).astype("int32")
    elif case.startswith("tied"):   # the tied model maps 3 features back to 3
        x = rng.standard_normal((ROWS, 3)).astype("float32")
    else:
        x = rng.standard_normal((ROWS, FEATURES)).astype("float32")
    return x, rng.standard_normal((ROWS, 3)).astype("float32")


class Probe(keras.callbacks.Callback):
    """Reads the weights after batch 2 of epoch 0; optionally holds a key."""

    def __init__(self, hold_batch=None):
        super().__init__()
        self.seen, self.hold_batch = None, hold_batch

    def on_train_batch_begin(self, batch, logs=None):
        ctl = overlap_fit.controller(self.model)
        if self.hold_batch == batch and ctl is not None and bps_tf.rank() == 0:
            # The last variable's sum of this step is kept from its wait
            # until the next step's first layer has run (or 10 s pass).
            collectives.debug_hold_push_pull(ctl.keys[-1], 10000)
            self.hold_batch = None

    def on_train_batch_end(self, batch, logs=None):
        if self.seen is None and batch == 2:
            self.seen = [np.array(w) for w in self.model.get_weights()]


def train(case, strategy, ckpt_dir, hold_batch=None):
    make_model, make_opt, spe = CASES[case]
    keras.utils.set_random_seed(7)
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=make_opt(), loss="mse", steps_per_execution=spe)
    x, y = data(case)
    flushes = case in FLUSH_CHECKED
    probe = Probe(hold_batch)
    path = os.path.join(ckpt_dir, f"{case}.weights.h5")
    ckpt = keras.callbacks.ModelCheckpoint(path, save_weights_only=True, save_freq=3 * spe)
    callbacks = [probe, ckpt] if flushes else [probe]
    if case == "graph_probe":
        # Only a callback that reads in a graph: the flush before user
        # batch callbacks must cover it (Probe would flush through get_weights).
        callbacks = [GraphProbe(), ckpt]
    hist = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                     validation_data=(x[:64], y[:64]) if flushes else None, callbacks=callbacks)
    ctl = overlap_fit.controller(model)
    out = {
        "pending_after_fit": ctl.pending() if ctl is not None else [],
        "weights": [np.array(v.numpy()) for v in model.weights],
        "optimizer": [np.array(v.numpy()) for v in model.optimizer.variables],
        "iterations": int(model.optimizer.iterations.numpy()),
        "history": hist.history,
        "probe": probe.seen if case != "graph_probe" else callbacks[0].sums,
        "overlapped": ctl is not None and ctl.enabled,
        "keys": list(ctl.keys) if ctl is not None else [],
    }
    if flushes:
        out["evaluate"] = model.evaluate(x[:64], y[:64], batch_size=GLOBAL_BATCH, verbose=0)
        out["predict"] = model.predict(x[:16], batch_size=GLOBAL_BATCH, verbose=0)
    if flushes and bps_tf.rank() == 0:   # rank 0 writes the real checkpoint file
        model.load_weights(path)
        out["checkpoint"] = [np.array(v.numpy()) for v in model.weights]
    return out


def same(what, got, want):
    if isinstance(want, dict):
        for k in want:
            same(f"{what}.{k}", got[k], want[k])
        return
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            raise AssertionError(f"{what}: {len(got)} items, want {len(want)}")
        for i, (g, w) in enumerate(zip(got, want)):
            same(f"{what}[{i}]", g, w)
        return
    g, w = np.asarray(got), np.asarray(want)
    if g.shape != w.shape or g.tobytes() != w.tobytes():
        diff = (np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)))
                if g.shape == w.shape else f"shape {g.shape} vs {w.shape}")
        raise AssertionError(f"{what} differs (max abs diff {diff})")


class LogLines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def check_case(case, off, on, ckpt_dir, log_lines, hold_batch=None):
    def run():
        want = train(case, off, ckpt_dir)
        del log_lines[:]
        got = train(case, on, ckpt_dir, hold_batch)
        for field in ("weights", "optimizer", "iterations", "history", "probe", "evaluate",
                      "predict", "checkpoint"):
            if field in want:
                same(field, got[field], want[field])
        if case in FLUSH_CHECKED and "val_loss" not in want["history"]:
            raise AssertionError(f"no validation ran: {sorted(want['history'])}")
        if want["iterations"] != EPOCHS * ROWS // GLOBAL_BATCH:
            raise AssertionError(f"iterations {want['iterations']}")
        if got["pending_after_fit"]:
            raise AssertionError(f"pending after fit: {got['pending_after_fit']}")
        if want["overlapped"]:
            raise AssertionError("the overlap=False strategy overlapped")
        return {"overlapped": got["overlapped"], "keys": got["keys"],
                "log": [line for line in log_lines if "overlap" in line],
                "n_weights": len(want["weights"])}
    return run


def check_recompile(strategy, log_lines):
    def run():
        x, y = data("sgd")
        with strategy.scope():
            model = dense_model()
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
        first = overlap_fit.controller(model) is not None
        del log_lines[:]
        with strategy.scope():
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
        if not first or overlap_fit.controller(model) is not None:
            raise AssertionError(f"overlapped first: {first}; after compile: "
                                 f"{overlap_fit.controller(model)}")
        if model.optimizer.iterations.numpy() != ROWS // GLOBAL_BATCH:
            raise AssertionError(f"iterations {model.optimizer.iterations.numpy()}")
        return {"log": [line for line in log_lines if "overlap" in line]}
    return run


def adam_dense_model(strategy):
    keras.utils.set_random_seed(7)
    with strategy.scope():
        model = dense_model()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def check_train_on_batch(off, on):
    """train_on_batch steps with reads between them -- one layer's kernel
    through numpy() and the model's output through a tf.function of the
    caller's: each read sees the barrier's weights."""
    def run():
        x, y = data("sgd")
        seen = {}
        for label, strategy in (("off", off), ("on", on)):
            model = adam_dense_model(strategy)
            reads = []
            forward = tf.function(lambda inputs: model(inputs, training=False))
            for step in range(4):
                rows = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
                model.train_on_batch(x[rows], y[rows])
                reads.append(model.layers[-1].kernel.numpy().copy())
                reads.append(forward(x[:4]).numpy())
            seen[label] = (reads, overlap_fit.controller(model) is not None)
        same("kernel reads", seen["on"][0], seen["off"][0])
        if not seen["on"][1]:
            raise AssertionError("train_on_batch did not overlap")
        return {"reads": len(seen["on"][0])}
    return run


class KernelEachStep(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.kernels = []

    def on_train_begin(self, logs=None):
        self.kernels.append(self.model.layers[-1].kernel.numpy().tobytes())

    def on_train_batch_end(self, batch, logs=None):
        self.kernels.append(self.model.layers[-1].kernel.numpy().tobytes())


def check_thread_reads(off, on):
    """A thread reads a kernel in a loop while fit runs: each read waits for
    the step running then (StepLock) and sees a weight the barrier run had
    after some step, never a half-applied one, and training stays exact."""
    def run():
        import threading
        x, y = data("sgd")
        final = {}
        for label, strategy in (("off", off), ("on", on)):
            model = adam_dense_model(strategy)
            model.predict(x[:4], verbose=0)   # built before the reader starts
            kernel, stop, reads, errors = model.layers[-1].kernel, threading.Event(), [], []

            def reader():
                try:
                    while not stop.is_set():
                        reads.append(kernel.numpy().tobytes())
                        # Each read waits for the step running and flushes:
                        # reading every 2 ms held the training back 10-fold.
                        time.sleep(0.02)
                except Exception as exc:   # pylint: disable=broad-except
                    errors.append(repr(exc))
            steps = KernelEachStep()
            thread = threading.Thread(target=reader, daemon=True)
            if label == "on":
                thread.start()
            model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                      callbacks=[] if label == "on" else [steps])
            stop.set()
            if label == "on":
                thread.join(60)
            final[label] = ([v.numpy() for v in model.weights], reads, errors, steps.kernels,
                            overlap_fit.controller(model))
        weights_off, _, _, barrier_kernels, _ = final["off"]
        weights_on, reads, errors, _, ctl = final["on"]
        if errors:
            raise AssertionError(f"reader thread failed: {errors}")
        if ctl is None or not ctl.enabled:
            raise AssertionError("the model did not overlap")
        same("weights", weights_on, weights_off)
        known = set(barrier_kernels)
        strange = sum(r not in known for r in reads)
        if not reads or strange:
            raise AssertionError(f"{strange} of {len(reads)} reads saw a kernel the barrier "
                                 f"never had")
        return {"reads": len(reads), "distinct": len(set(reads)), "steps": len(known)}
    return run


class CalledInReverse(keras.Model):
    """Layers created (and listed in trainable_variables) in the reverse of
    the order the forward pass calls them."""

    def __init__(self):
        super().__init__()
        self.third = keras.layers.Dense(3)
        self.second = keras.layers.Dense(8, activation="relu")
        self.first = keras.layers.Dense(8, activation="relu")

    def call(self, x):
        return self.third(self.second(self.first(x)))


def check_priorities(on):
    """The starts' priorities follow the forward pass's first reads."""
    def run():
        x, y = data("sgd")
        with on.scope():
            model = CalledInReverse()
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
        ctl = overlap_fit.controller(model)
        if ctl is None or not ctl.enabled:
            raise AssertionError("the model did not overlap")
        return {"variables": [v.path for v in ctl.variables],
                "priorities": [ctl.priorities.get(k) for k in ctl.keys]}
    return run


def check_arguments(rank):
    def run():
        found = {}
        for name, make in (
                ("not_bool", lambda: BytePSStrategy(overlap="yes")),
                ("fp16", lambda: BytePSStrategy(overlap=True, compression=bps_tf.Compression.fp16)),
                # The workers disagree: every one of them must refuse.
                ("disagree", lambda: BytePSStrategy(overlap=(rank == 0)))):
            try:
                make()
            except ValueError as exc:
                found[name] = str(exc)
            else:
                raise AssertionError(f"{name}: BytePSStrategy accepted it")
        return found
    return run


def main():
    out_dir = sys.argv[1]
    bps_tf.init()
    rank, size = bps_tf.rank(), bps_tf.size()
    checks = Checks(out_dir, rank, size)
    log_lines = LogLines()
    logging.getLogger("bps_tf").addHandler(log_lines)
    off, on = BytePSStrategy(overlap=False), BytePSStrategy(overlap=True)
    ckpt_dir = tempfile.mkdtemp(prefix=f"overlap_fit_{rank}_", dir=out_dir)  # the test's own
    checks.run("sgd", check_case("sgd", off, on, ckpt_dir, log_lines.lines, hold_batch=3))
    checks.run("hold_log", lambda: {"log": collectives.debug_hold_log()})
    for case in CASES:
        if case != "sgd":
            checks.run(case, check_case(case, off, on, ckpt_dir, log_lines.lines))
    checks.run("recompile", check_recompile(on, log_lines.lines))
    checks.run("train_on_batch", check_train_on_batch(off, on))
    checks.run("thread_reads", check_thread_reads(off, on))
    checks.run("priorities", check_priorities(on))
    checks.run("writes", check_writes(off, on, ckpt_dir))
    checks.run("arguments", check_arguments(rank))
    bps_tf.shutdown()


if __name__ == "__main__":
    main()
