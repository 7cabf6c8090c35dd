"""Runs bps_tf against a Keras whose names a release renamed (a copy of the
installed Keras, rewritten by tests/test_hook_renames.py and put first on
sys.path), and writes what happened as JSON. Every failure is recorded
with its type: the test asserts there is no AttributeError among them.

    hook_renames.py tensorflow OUT   # Keras as installed: every entry's Keras name, and
                                     # each TensorFlow entry moved in turn
    hook_renames.py registry OUT     # every Keras name renamed: each entry found missing
    hook_renames.py alone OUT        # private names renamed (and check_finite gone):
                                     # one process trains
    hook_renames.py workers OUT      # the private names renamed in a 2-worker job
"""
import json
import logging
import os
import sys
import traceback

OUT = sys.argv[2]
RESULTS = {}
WARNINGS = []


class _Keep(logging.Handler):
    def emit(self, record):
        WARNINGS.append(record.getMessage())


logging.getLogger("bps_tf").addHandler(_Keep())


def outcome(fn):
    """"ok: ..." or "<ExceptionType>: message" of ``fn()``."""
    try:
        return "ok: " + str(fn())
    except Exception as exc:  # recorded, asserted by the test
        name = type(exc).__name__
        if name == "AttributeError":
            name += " " + traceback.format_exc()[-1500:]
        return f"{name}: {exc}"


def write(name):
    with open(os.path.join(OUT, name), "w") as f:
        json.dump({"results": RESULTS, "warnings": WARNINGS}, f)


def _declaring():
    import importlib.util
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("gen_hooks_doc",
                                                  os.path.join(root, "tools", "gen_hooks_doc.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen.declare_all()


def tensorflow_run():
    registry = _declaring()
    RESULTS["names"] = {h.name: h.keras_name for h in registry.hooks()}
    RESULTS["moved"] = {h.name: outcome(lambda: _moved_one(registry, h))
                        for h in registry.hooks() if not h.keras_name}
    write("tensorflow.json")


def registry_run():
    import keras
    RESULTS["keras_file"] = keras.__file__
    registry = _declaring()
    RESULTS["entries"] = {h.name: outcome(lambda: registry.check(h.name) or "FOUND")
                          for h in registry.hooks() if h.keras_name}
    RESULTS["kinds"] = {h.name: [h.kind, h.when_missing, h.group, h.feature, h.keras_name]
                        for h in registry.hooks()}
    import bps_tf
    RESULTS["strategy"] = outcome(lambda: bps_tf.BytePSStrategy())
    from bps_tf.overlap import fit as overlap_fit
    RESULTS["overlap_installed"] = outcome(overlap_fit.install)
    write("registry.json")


def _moved_one(registry, hook):
    """A TensorFlow (or tf_keras) entry: its target removed where it is
    defined, looked for, then put back."""
    import inspect
    if registry.check(hook.name):
        return "absent here: " + registry.check(hook.name)
    owner, attr = hook.locate()
    owners = [c for c in owner.__mro__ if attr in vars(c)] if inspect.isclass(owner) else [owner]
    saved = [vars(o)[attr] if inspect.isclass(o) else getattr(o, attr) for o in owners]
    for o in owners:
        delattr(o, attr)
    try:
        return registry.check(hook.name) or "FOUND"
    finally:
        for o, value in zip(owners, saved):
            setattr(o, attr, value)


def _small_model(keras, **compile_args):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", **compile_args)
    return model


def alone_run():
    import numpy as np
    import keras
    # A public method gone too: only the feature that needs it refuses.
    del keras.optimizers.LossScaleOptimizer.check_finite
    import bps_tf
    import bps_tf.keras
    from bps_tf.hooks import registry
    RESULTS["keras_file"] = keras.__file__
    x = np.random.RandomState(0).normal(size=(64, 8)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")

    def train(**options):
        keras.utils.set_random_seed(1)
        strategy = bps_tf.BytePSStrategy(**options)
        with strategy.scope():
            model = _small_model(keras)
        model.fit(x, y, batch_size=16, epochs=2, verbose=0)
        model.evaluate(x, y, verbose=0)
        model.predict(x, verbose=0)
        return strategy.overlap, [w.tolist() for w in model.get_weights()]

    trained = []
    RESULTS["fit"] = outcome(lambda: trained.append(train()) or trained[0][0])
    RESULTS["same_as_barrier"] = outcome(lambda: trained[0][1] == train(overlap=False)[1])

    def overlapped_apply():
        from bps_tf.overlap.loop import OverlappedApply
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        return OverlappedApply(model, keras.optimizers.SGD(0.1), prefix="renamed")

    RESULTS["overlapped_apply"] = outcome(overlapped_apply)
    RESULTS["sync_batch_norm"] = outcome(lambda: bps_tf.keras.SyncBatchNormalization())
    RESULTS["distributed_optimizer"] = outcome(
        lambda: bps_tf.keras.DistributedOptimizer(keras.optimizers.SGD(0.1)))

    def loss_scaling():
        with bps_tf.BytePSStrategy().scope():
            keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)).build(
                [keras.Variable(1.0)])

    RESULTS["loss_scaling"] = outcome(loss_scaling)
    RESULTS["missing"] = sorted(registry.missing())
    write("alone.json")


def workers_run():
    import numpy as np
    import keras
    import bps_tf
    from bps_tf.hooks import registry
    strategy = bps_tf.BytePSStrategy()
    rank = bps_tf.rank()
    RESULTS["keras_file"] = keras.__file__

    def fit(rows):
        rng = np.random.RandomState(rank)
        x = rng.normal(size=(rows, 8)).astype("float32")
        y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
        with strategy.scope():
            model = _small_model(keras)
        model.fit(x, y, batch_size=16, epochs=2, verbose=0)
        return model.evaluate(x, y, batch_size=16, verbose=0)

    import time
    RESULTS["equal_counts"] = outcome(lambda: fit(64))
    started = time.time()
    RESULTS["different_counts"] = outcome(lambda: fit(48 if rank == 0 else 80))
    RESULTS["different_counts_seconds"] = time.time() - started

    def backup(folder):
        x = np.ones((32, 8), "float32")
        with strategy.scope():
            model = _small_model(keras)
        model.fit(x, x[:, :1], batch_size=16, epochs=1, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(folder)])

    RESULTS["backup_and_restore"] = outcome(lambda: backup(os.path.join(OUT, f"backup{rank}")))
    RESULTS["missing"] = sorted(registry.missing())
    write(f"rank{rank}.json")


if __name__ == "__main__":
    {"tensorflow": tensorflow_run, "registry": registry_run, "alone": alone_run,
     "workers": workers_run}[sys.argv[1]]()
