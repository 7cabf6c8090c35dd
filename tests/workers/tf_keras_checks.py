"""Keras 2 (tf_keras) checks, run under TF_USE_LEGACY_KERAS=1 by
tests/test_tf_keras.py: the Horovod Keras-2 way of training (tf.keras
optimizers wrapped by bps_tf.keras.DistributedOptimizer, the callbacks,
fit) must train one model, the same on every worker and equal to one
process training on every worker's batches."""
import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_record import Checks  # noqa: E402

import bps_tf.keras as hvd  # noqa: E402

BATCH, STEPS, FEATURES = 8, 6, 5


def rank_data(rank):
    rng = np.random.RandomState(100 + rank)
    x = rng.normal(size=(BATCH * STEPS, FEATURES)).astype(np.float32)
    y = (x @ np.arange(1, FEATURES + 1, dtype=np.float32)[:, None] * 0.1
         + rng.normal(scale=0.01, size=(BATCH * STEPS, 1))).astype(np.float32)
    return x, y


def make_model(seed=7):
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([tf.keras.Input((FEATURES,)),
                                tf.keras.layers.Dense(4, activation="tanh"),
                                tf.keras.layers.Dense(1)])


def same_on_every_rank(what, values):
    """Raises unless every rank holds exactly these values."""
    flat = np.concatenate([np.ravel(v).astype(np.float64) for v in values])[None, :]
    gathered = hvd.allgather(tf.constant(flat)).numpy()
    for r in range(1, gathered.shape[0]):
        if not np.array_equal(gathered[0], gathered[r]):
            diff = np.max(np.abs(gathered[0] - gathered[r]))
            raise AssertionError(f"{what}: rank {r} differs from rank 0 by up to {diff}")


def reference_weights(size, optimizer, epochs=1, passes=1):
    """One process on the batches of every rank, side by side (``passes``
    consecutive steps of every rank in one batch)."""
    data = [rank_data(r) for r in range(size)]
    x = np.concatenate([np.concatenate([d[0][s * BATCH:(s + 1) * BATCH] for d in data])
                        for s in range(STEPS)])
    y = np.concatenate([np.concatenate([d[1][s * BATCH:(s + 1) * BATCH] for d in data])
                        for s in range(STEPS)])
    model = make_model()
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=BATCH * size * passes, epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights()


def check_is_tf_keras():
    name = type(tf.keras.optimizers.SGD(0.1)).__module__
    if not name.startswith("tf_keras."):
        raise AssertionError(f"tf.keras is not tf_keras here: {name}")
    # Keras-2-era scripts read it (Horovod's Keras tests): importing bps_tf.keras gives it
    import tf_keras
    from tensorflow import keras as tf_dot_keras
    if tf_dot_keras.__version__ != tf_keras.__version__:
        raise AssertionError(f"tf.keras.__version__ = {tf_dot_keras.__version__!r}")
    return name


def check_fit_equals_one_process(rank, size, make_optimizer, **wrap):
    x, y = rank_data(rank)
    model = make_model()
    opt = hvd.DistributedOptimizer(make_optimizer(), **wrap)
    model.compile(optimizer=opt, loss="mse")
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                   hvd.callbacks.MetricAverageCallback()])
    weights = model.get_weights()
    same_on_every_rank("weights", weights)
    same_on_every_rank("averaged loss", history.history["loss"])
    want = reference_weights(size, make_optimizer(), epochs=2)
    for got, ref in zip(weights, want):
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6)
    if "bps_tf" not in type(opt).__mro__[1].__module__:
        raise AssertionError(f"not wrapped: {type(opt).__mro__}")
    return f"{type(opt).__name__} from {type(opt).__module__}: loss {history.history['loss']}"


def check_aggregated_fit(rank, size, average):
    """backward_passes_per_step=2: the wrapper sums two batches locally and
    exchanges once. The passes run on the same weights, so an update is the
    one-process update on all 2 x size batches, with the learning rate
    doubled when the passes are summed (Horovod's default), not averaged."""
    x, y = rank_data(rank)
    model = make_model()
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.05),
                                   backward_passes_per_step=2,
                                   average_aggregated_gradients=average)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    weights = model.get_weights()
    same_on_every_rank("aggregated weights", weights)
    want = reference_weights(size, tf.keras.optimizers.SGD(0.05 if average else 0.1),
                             epochs=2, passes=2)
    for got, ref in zip(weights, want):
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6)
    counted = (int(opt.iterations.numpy()), int(opt._agg_helper.counter.numpy()))
    if counted != (2 * STEPS, 0):
        raise AssertionError(f"(iterations, batches pending) = {counted}, "
                             f"want ({2 * STEPS}, 0)")
    return counted


def check_local_var_and_compute_gradients(rank, size):
    """register_local_var keeps a gradient on its worker (divided by the
    size, Horovod's scale_local_gradients); _compute_gradients returns the
    reduced gradients, and the apply_gradients after it does not reduce them
    again, also when the script changed them in between (with op=Sum a second
    reduction would multiply by the size)."""
    shared = tf.Variable([0.0, 0.0])
    own = tf.Variable([0.0])
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(1.0), op=hvd.Sum)
    opt.register_local_var(own)
    weight = float(rank + 1)

    def loss():
        return weight * tf.reduce_sum(shared) + 3.0 * weight * own[0]

    grads_and_vars = opt._compute_gradients(loss, var_list=[shared, own])
    grads = {id(v): g.numpy() for g, v in grads_and_vars}
    total = size * (size + 1) / 2.0
    np.testing.assert_allclose(grads[id(shared)], [total, total])
    np.testing.assert_allclose(grads[id(own)], [3.0 * weight / size])
    opt.apply_gradients([(tf.identity(g), v) for g, v in grads_and_vars])   # e.g. clipped
    np.testing.assert_allclose(shared.numpy(), [-total, -total])
    np.testing.assert_allclose(own.numpy(), [-3.0 * weight / size])
    return float(shared.numpy()[0]), float(own.numpy()[0])


def check_sync_batch_norm(rank, size):
    """bps_tf.keras.SyncBatchNormalization is a tf_keras layer here (it goes
    into a tf_keras Sequential) and normalizes with the statistics of every
    worker's batch: a training step gives each worker its rows of what one
    BatchNormalization gives on all rows, and the same moving statistics."""
    every = np.stack([np.arange(12, dtype=np.float32).reshape(4, 3) * (r + 1) + r
                      for r in range(size)])          # [size, 4 rows, 3 channels]
    sync = hvd.SyncBatchNormalization(momentum=0.5)
    if not isinstance(sync, tf.keras.layers.BatchNormalization) or sync.fused:
        raise AssertionError(f"{type(sync).__mro__} is not an unfused tf_keras layer")
    model = tf.keras.Sequential([tf.keras.Input((3,)), sync])
    plain = tf.keras.layers.BatchNormalization(momentum=0.5)
    got = model(every[rank], training=True).numpy()
    want = plain(every.reshape(-1, 3), training=True).numpy().reshape(size, 4, 3)[rank]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for name in ("moving_mean", "moving_variance"):
        np.testing.assert_allclose(getattr(sync, name).numpy(), getattr(plain, name).numpy(),
                                   rtol=1e-5)
    try:
        hvd.SyncBatchNormalization(fused=True)
    except ValueError:
        return float(np.max(np.abs(got - want)))
    raise AssertionError("SyncBatchNormalization(fused=True) was accepted")


def check_load_model(rank, size, out_dir):
    """bps_tf.keras.load_model on a tf_keras model (.keras and .h5) returns
    it with its optimizer distributed again and the state tf_keras restores
    (.h5 restores a legacy optimizer's slots, tf_keras' .keras does not);
    training on goes on the same on every worker."""
    from bps_tf.keras.legacy_optimizer import LegacyDistributedMixin
    x, y = rank_data(rank)
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.legacy.RMSprop(0.01)),
                  loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    done = []
    for suffix in ("keras", "h5"):
        path = os.path.join(out_dir, f"model.rank{rank}.{suffix}")
        model.save(path)
        loaded = hvd.load_model(path)
        if not isinstance(loaded.optimizer, LegacyDistributedMixin):
            raise AssertionError(f"{suffix}: optimizer {type(loaded.optimizer).__mro__} "
                                 "is not distributed")
        plain = tf.keras.models.load_model(path).optimizer
        got, want = (int(o.iterations.numpy()) for o in (loaded.optimizer, plain))
        if got != want or (suffix == "h5" and got != STEPS):
            raise AssertionError(f"{suffix}: iterations {got}, plain tf_keras restores {want}")
        loaded.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        same_on_every_rank(f"weights after training the loaded {suffix} model",
                           loaded.get_weights())
        done.append(suffix)
    return " ".join(done)


def check_momentum_correction(rank):
    """LearningRateScheduleCallback with a tf_keras legacy SGD: the first
    batch at the new rate runs with momentum * new / old (Horovod's momentum
    correction), the next batches with the momentum again; off with
    momentum_correction=False."""
    x, y = rank_data(rank)
    seen = {}
    for correction in (True, False):
        model = make_model()
        opt = tf.keras.optimizers.legacy.SGD(0.01, momentum=0.9)
        model.compile(optimizer=hvd.DistributedOptimizer(opt), loss="mse")
        schedule = hvd.callbacks.LearningRateScheduleCallback(
            0.01, lambda epoch: 1.0 if epoch < 1 else 0.1, momentum_correction=correction)
        momenta = []
        record = tf.keras.callbacks.LambdaCallback(on_batch_begin=lambda b, logs: momenta.append(
            round(float(model.optimizer.momentum.numpy()), 6)))
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=[schedule, record])
        seen[correction] = momenta[STEPS:STEPS + 2] + [momenta[-1]]
    if seen != {True: [0.09, 0.9, 0.9], False: [0.9, 0.9, 0.9]}:
        raise AssertionError(f"momentum at epoch 2's first, second and last batch: {seen}")
    return str(seen[True])


def check_warmup_reaches_initial_lr(rank, size):
    x, y = rank_data(rank)
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)), loss="mse")
    seen = []
    record = tf.keras.callbacks.LambdaCallback(
        on_batch_begin=lambda b, logs: seen.append(float(model.optimizer.learning_rate.numpy())))
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.LearningRateWarmupCallback(
                  initial_lr=0.04, warmup_epochs=1, steps_per_epoch=STEPS), record])
    if abs(seen[0] - 0.04 / size) > 1e-7 or abs(seen[-1] - 0.04) > 1e-7:
        raise AssertionError(f"warmup learning rates {seen}")
    same_on_every_rank("weights after warmup", model.get_weights())
    return seen


def check_elastic_keras_state(rank):
    """hvd.elastic.KerasState over a tf_keras model whose legacy optimizer
    lists its variables through a method: sync gives rank 0's weights and
    slots, restore brings back the last commit."""
    x, y = rank_data(rank)
    model = make_model(seed=7 + rank)          # different start on every rank
    model.compile(optimizer=hvd.DistributedOptimizer(
        tf.keras.optimizers.legacy.Adam(0.01)), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    state = hvd.elastic.KerasState(model, batch=rank, epoch=3)
    slots = model.optimizer.variables()
    if not any(v is s for v in state.variables for s in slots) or len(slots) < 2:
        raise AssertionError("KerasState left out the legacy optimizer's variables")
    state.sync()
    same_on_every_rank("weights after sync", model.get_weights())
    same_on_every_rank("optimizer slots after sync", [v.numpy() for v in slots])
    if state.batch != 0:
        raise AssertionError(f"batch after sync: {state.batch}")
    synced = [w.copy() for w in model.get_weights()]
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    state.batch = 5
    state.restore()
    for got, want in zip(model.get_weights(), synced):
        np.testing.assert_array_equal(got, want)
    if state.batch != 0:
        raise AssertionError(f"batch after restore: {state.batch}")
    return len(state.variables)


def check_elastic_callbacks_in_tf_keras_fit(rank):
    """Horovod's elastic Keras callbacks run in tf_keras' fit: they are
    tf_keras callbacks, a subclass's commit() is called (Horovod's own test
    counts commits so), and the state follows the epochs and batches."""
    x, y = rank_data(rank)
    model = make_model(seed=3)
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.01)),
                  loss="mse")
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    state = hvd.elastic.KerasState(model, batch=0, epoch=0, commits=0)

    class Tracking(hvd.elastic.CommitStateCallback):
        def commit(self):
            self.state.commits += 1
            super().commit()

    callbacks = [Tracking(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]
    if not all(isinstance(c, tf.keras.callbacks.Callback) for c in callbacks):
        raise AssertionError("the elastic callbacks are not tf_keras callbacks")
    steps = len(x) // BATCH
    model.fit(x[:steps * BATCH], y[:steps * BATCH], batch_size=BATCH, epochs=2, shuffle=False,
              callbacks=callbacks, verbose=0)
    # A commit when each batch after the first begins, at each epoch's start
    # and at the end: 2 * steps in all.
    if (state.epoch, state.batch, state.commits) != (2, 0, 2 * steps):
        raise AssertionError(f"epoch/batch/commits {state.epoch}/{state.batch}/{state.commits}, "
                             f"expected 2/0/{2 * steps}")
    return state.commits


def check_broadcast_callback_on_a_model_built_by_fit(rank):
    """A Sequential without an input shape is built by tf_keras' first step,
    after on_train_begin: the callback broadcasts after the first batch
    instead (Horovod's timing), and every rank ends with rank 0's weights."""
    x, y = rank_data(rank)
    tf.keras.utils.set_random_seed(11 + rank)           # a different start on every rank
    model = tf.keras.Sequential([tf.keras.layers.Dense(4, activation="tanh"),
                                 tf.keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.01)),
                  loss="mse")
    if model.built:
        raise AssertionError("the model is built before fit: the check tests nothing")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    same_on_every_rank("weights after fit", model.get_weights())
    return len(model.get_weights())


def check_mixed_precision_overflow_on_one_rank(rank, legacy):
    """mixed_float16 wraps the wrapper in tf_keras' LossScaleOptimizer: an
    overflow in rank 0's second batch alone must skip that step everywhere
    (its inf/nan check runs on the sums, as Horovod's)."""
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = rank_data(rank)
        if rank == 0:
            x[BATCH:BATCH + 2] *= 1e5
        model = make_model()
        optimizer = (tf.keras.optimizers.legacy.SGD if legacy else tf.keras.optimizers.SGD)(0.01)
        model.compile(optimizer=hvd.DistributedOptimizer(optimizer), loss="mse")
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        scale = float(model.optimizer.loss_scale.numpy())
        initial = float(model.optimizer.initial_scale)
        if not scale < initial:
            raise AssertionError(f"loss scale {scale}: no step was skipped")
        weights = model.get_weights()
        if not all(np.isfinite(w).all() for w in weights):
            raise AssertionError("non-finite weights")
        same_on_every_rank("loss scale", [scale])   # rank 1 skipped rank 0's overflow too
        same_on_every_rank("weights", weights)
        return f"scale {scale:g}"
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")


def check_compression_under_a_strategy_is_refused():
    """The strategy reduces the gradients, so the wrapper's compression would
    be ignored: refused, not silently dropped."""
    with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
        model = make_model()
        model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1),
                                                         compression=hvd.Compression.fp16),
                      loss="mse")
    x, y = rank_data(0)
    try:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    except ValueError as exc:
        if "Pass it to the strategy instead" not in str(exc):
            raise
        return str(exc)[:200]
    raise AssertionError("compression under a strategy was accepted")


def main():
    out_dir = sys.argv[1]
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checks = Checks(out_dir, rank, size)
    checks.run("is_tf_keras", check_is_tf_keras)
    checks.run("sgd_fit", lambda: check_fit_equals_one_process(
        rank, size, lambda: tf.keras.optimizers.SGD(0.05)))
    checks.run("legacy_momentum_fit", lambda: check_fit_equals_one_process(
        rank, size, lambda: tf.keras.optimizers.legacy.SGD(0.05, momentum=0.9)))
    checks.run("adam_predivide_fit", lambda: check_fit_equals_one_process(
        rank, size, lambda: tf.keras.optimizers.Adam(0.01), gradient_predivide_factor=2.0))
    checks.run("warmup", lambda: check_warmup_reaches_initial_lr(rank, size))
    checks.run("aggregated_fit_summed", lambda: check_aggregated_fit(rank, size, False))
    checks.run("aggregated_fit_averaged", lambda: check_aggregated_fit(rank, size, True))
    checks.run("local_var", lambda: check_local_var_and_compute_gradients(rank, size))
    checks.run("sync_batch_norm", lambda: check_sync_batch_norm(rank, size))
    checks.run("load_model", lambda: check_load_model(rank, size, out_dir))
    checks.run("momentum_correction", lambda: check_momentum_correction(rank))
    checks.run("compression_under_strategy", check_compression_under_a_strategy_is_refused)
    checks.run("mixed_precision", lambda: check_mixed_precision_overflow_on_one_rank(rank, False))
    checks.run("mixed_precision_legacy",
               lambda: check_mixed_precision_overflow_on_one_rank(rank, True))
    checks.run("elastic_keras_state", lambda: check_elastic_keras_state(rank))
    checks.run("elastic_callbacks", lambda: check_elastic_callbacks_in_tf_keras_fit(rank))
    checks.run("broadcast_unbuilt", lambda: check_broadcast_callback_on_a_model_built_by_fit(rank))
    checks.run("finished", lambda: None)


if __name__ == "__main__":
    main()
