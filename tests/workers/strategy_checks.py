"""Worker script for test_strategy.py: BytePSStrategy with Keras 3 model.fit.

    bpslaunch -np 2 --servers 2 python tests/workers/strategy_checks.py OUT_DIR

Every worker has 2 logical CPU devices (4 replicas in all) and runs the same
scenarios in the same order. For each scenario it writes
OUT_DIR/<scenario>.rank<r>.npz (initial and final weights) and a line in
OUT_DIR/rank<r>.json (history, evaluate() results, ...). The test compares
the workers with each other and with a single-process reference.

The reference: after all distributed work (so that nothing it creates can
shift a collective), one worker per scenario trains a plain model -- no strategy, one device
-- from the same initial weights on the same global batches (shuffle=False:
global batch k is rows [16k, 16k+16) and the workers' shards of batch k are
exactly those rows). It writes OUT_DIR/<scenario>.reference.npz and
OUT_DIR/<scenario>.reference.json.

Scenario "bn": BatchNormalization(synchronized=False), one on the raw
features ("in_bn"), Adam and Embedding: every weight, moving statistics
included, must end identical on both workers and both local replicas, and
in_bn's moving statistics are compared with the reference and with numpy.
model.predict(x[:10]) is recorded in every scenario ("dropout" uses
BytePSStrategy(predict="shard")); after the references every worker also
predicts those rows with a plain model holding the sgd model's weights.

Dropout: the "dropout" scenario uses rate 0.5 and is only compared across
workers (and, to save time, runs without validation data) (the seed-generator state is a mirrored variable, so every worker
draws the same masks); a single process drawing one mask for the global
batch cannot match it. The scenarios compared with the reference use
Dropout(rate=0.0), which keeps the layer in the graph but draws nothing.
"""
import json
import os
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import bps_tf  # noqa: E402
from bps_tf.strategy import BytePSStrategy, gather_predictions  # noqa: E402

EPOCHS = 3
GLOBAL_BATCH = 16
N_TRAIN, N_VAL = 96, 44          # 6 full training batches; a partial validation batch
VOCAB, TOKENS, FEATURES, CLASSES = 20, 5, 8, 3


def make_data():
    rng = np.random.RandomState(1234)
    feats = rng.randn(N_TRAIN + N_VAL, FEATURES).astype("float32")
    tokens = rng.randint(0, VOCAB, size=(N_TRAIN + N_VAL, TOKENS)).astype("int32")
    labels = (np.argmax(feats[:, :CLASSES], axis=1) + tokens[:, 0]) % CLASSES
    split = lambda a: (a[:N_TRAIN], a[N_TRAIN:])  # noqa: E731
    (ft, fv), (tt, tv), (yt, yv) = split(feats), split(tokens), split(labels)
    return ({"feats": ft, "tokens": tt}, yt), ({"feats": fv, "tokens": tv}, yv)


def make_model(dropout, sync_bn=True, input_bn=False):
    feats = keras.Input((FEATURES,), name="feats")
    tokens = keras.Input((TOKENS,), name="tokens", dtype="int32")
    embedded = keras.layers.Embedding(VOCAB, 4)(tokens)           # sparse gradient
    pooled = keras.layers.GlobalAveragePooling1D()(embedded)
    # in_bn sees the raw features: its moving statistics depend on the data
    # only, so they can be checked against one process on the global batches.
    f = keras.layers.BatchNormalization(name="in_bn")(feats) if input_bn else feats
    h = keras.layers.Concatenate()([f, pooled])
    h = keras.layers.Dense(16, activation="relu")(h)
    h = keras.layers.BatchNormalization(synchronized=sync_bn)(h)
    h = keras.layers.Dropout(dropout, seed=7)(h)
    out = keras.layers.Dense(CLASSES)(h)
    return keras.Model({"feats": feats, "tokens": tokens}, out)


def make_optimizer(name):
    return keras.optimizers.SGD(0.1) if name == "sgd" else keras.optimizers.Adam(0.01)


def compile_model(model, optimizer):
    model.compile(optimizer=make_optimizer(optimizer),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], steps_per_execution=2)


# (name, optimizer, dropout rate, has a reference run)
SCENARIOS = [("sgd", "sgd", 0.0, True), ("adam", "adam", 0.0, True),
             ("dropout", "sgd", 0.5, False), ("bn", "adam", 0.0, True)]
# "bn": BatchNormalization NOT synchronized (each replica normalizes with its
# own batch moments), one on the raw features: the moving statistics are
# updated per replica and averaged over all replicas of all workers.
MODEL_OPTIONS = {"bn": {"sync_bn": False, "input_bn": True}}
# "dropout" keeps Keras' per-shard predict, to check the option.
STRATEGY_OPTIONS = {"dropout": {"predict": "shard"}}
PREDICT_ROWS = 10          # model.predict(x[:10], batch_size=4): odd counts per worker


class Recorder(keras.callbacks.Callback):
    """Writes where every save went, to check that only rank 0 wrote."""

    def __init__(self, saves):
        super().__init__()
        self.saves = saves

    def on_train_begin(self, logs=None):
        original = self.model.save_weights
        saves = self.saves

        def save_weights(filepath, *args, **kwargs):
            saves.append(str(filepath))
            return original(filepath, *args, **kwargs)
        self.model.save_weights = save_weights


def primitives(strategy, rank):
    """tf.distribute calls Keras and input_lib make, checked with known values."""
    out = {}
    # A host int64 tensor, one per worker (input_lib's end-of-data count).
    out["host_sum"] = int(strategy.reduce("SUM", tf.constant(rank + 1, tf.int64), axis=None))
    ids = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant([float(ctx.replica_id_in_sync_group)]))
    out["replica_ids"] = [float(v.numpy()[0]) for v in strategy.experimental_local_results(ids)]
    # Nested structures (Keras reduces its first batch this way).
    nested = strategy.reduce("MEAN", {"a": ids, "b": (ids, ids)}, axis=None)
    out["nested_mean"] = [float(nested["a"].numpy()[0]), float(nested["b"][1].numpy()[0])]
    out["gather"] = [float(v) for v in strategy.gather(ids, axis=0).numpy()]
    ones = strategy.run(lambda: tf.constant(1, tf.int32))
    out["int32_sum"] = int(strategy.reduce("SUM", ones, axis=None))
    # Variables assigned in replica context, by aggregation; "state": a
    # non-trainable float variable without one (as Keras 3 makes them).
    agg = tf.VariableAggregation
    with strategy.scope():
        variables = {"mean": tf.Variable(0.0, aggregation=agg.MEAN),
                     "sum": tf.Variable(0.0, aggregation=agg.SUM),
                     "first": tf.Variable(0.0, aggregation=agg.ONLY_FIRST_REPLICA),
                     "state": tf.Variable(0.0, trainable=False)}

    def assign_all():
        rid = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
        variables["mean"].assign(rid)
        variables["sum"].assign(rid * 0.0 + 1.0)      # a per-replica 1
        variables["first"].assign(rid + 10.0 * (rank + 1))
        variables["state"].assign(rid)
    strategy.run(tf.function(assign_all))
    out["assigned"] = {k: [float(c.numpy()) for c in v.values] for k, v in variables.items()}
    return out


DATA_COUNTS = (3, 8)   # elements of each worker's own dataset (uneven)


def uneven_data(strategy, rank):
    """A custom loop over datasets of different lengths per worker: the sums
    of every step, traced and eager, and whether a traced step whose workers
    all have a batch ran without waiting for the end-of-data sum."""
    from bps_tf.comm import collectives
    out = {}

    def dataset_fn(ctx):
        return tf.data.Dataset.range(DATA_COUNTS[ctx.input_pipeline_id]).batch(1)

    def step_sum(it):
        batch = next(it)
        local = strategy.run(lambda t: tf.reduce_sum(t), args=(batch,))
        return strategy.reduce("SUM", local, axis=None)

    def run_loop(step):
        sums, it = [], iter(strategy.distribute_datasets_from_function(dataset_fn))
        while len(sums) < 20:
            try:
                sums.append(int(step(it)))
            except (tf.errors.OutOfRangeError, StopIteration):
                break
        return sums

    out["traced"] = run_loop(tf.function(step_sum))
    out["eager"] = run_loop(step_sum)

    @tf.function
    def marked_step(it):
        return collectives.debug_marker(step_sum(it))

    it = iter(strategy.distribute_datasets_from_function(dataset_fn))
    marked_step(it)   # leaves this site's end-of-data sum pending
    keys = [k for k in collectives.pending_push_pulls() if "data_check" in k and "eager" not in k]
    out["pending_keys"] = keys
    collectives.debug_hold_push_pull(keys[0], 10000)
    marked_step(it)   # both workers still have a batch
    out["hold_log"] = collectives.debug_hold_log()
    return out


def own_data(dataset):
    """``dataset`` as this worker's own: not sharded across workers."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return dataset.with_options(options)


def own_datasets(rank):
    """fit on each worker's own dataset (AutoShardPolicy.OFF): a batch of 8
    is a global batch, 2 rows per replica, 4 rows per worker and step. First
    a fit on an infinite dataset (Keras keeps that traced step for the next
    fits), then rank 0 24 rows / rank 1 40 rows, then 40 rows each: the
    batches of each epoch, which must cover every worker's rows."""
    strategy = new_strategy()
    with strategy.scope():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")

    def data(rows):
        rng = np.random.default_rng(rank)
        x = rng.normal(size=(rows, FEATURES)).astype("float32")
        return own_data(tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(8))

    class Batches(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append(0)

        def on_train_batch_end(self, batch, logs=None):
            seen[-1] += 1

    out = {}
    model.fit(data(16).repeat(), steps_per_epoch=2, epochs=1, verbose=0)
    for label, rows in (("uneven", 24 if rank == 0 else 40), ("even", 40)):
        seen = []
        model.fit(data(rows), epochs=2, verbose=0, callbacks=[Batches()])
        out[label] = seen
    out["weights"] = np.concatenate([v.numpy().ravel() for v in model.weights]).tolist()
    return out


def mixed_precision(rank, poisoned):
    """model.fit under a mixed_float16 policy (Keras wraps the optimizer in
    a LossScaleOptimizer), each worker on its own 32 rows (8 steps of 4).
    ``poisoned``: rank 0's third step overflows float16 on one of its
    replicas only, so every replica of every worker must skip it together."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        rng = np.random.default_rng(rank)
        x = rng.normal(size=(4 * GLOBAL_BATCH // 2, FEATURES)).astype("float32")
        y = rng.normal(size=(len(x), 1)).astype("float32")
        if poisoned and rank == 0:
            x[GLOBAL_BATCH // 2:GLOBAL_BATCH // 2 + 2] *= 1e5   # replica 0 of step 1
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH // 2)
        strategy = new_strategy()
        with strategy.scope():
            keras.utils.set_random_seed(3)
            model = keras.Sequential([keras.Input((FEATURES,)),
                                      keras.layers.Dense(8, activation="relu"),
                                      keras.layers.Dense(1, dtype="float32")])
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        model.fit(own_data(data), epochs=1, verbose=0)
        optimizer = model.optimizer
        weights = np.concatenate([v.numpy().ravel() for v in model.weights])
        return {"optimizer": type(optimizer).__name__,
                "iterations": int(optimizer.iterations.numpy()),
                "scale": float(optimizer.dynamic_scale.numpy()),
                "initial_scale": float(optimizer.initial_scale),
                "finite": bool(np.isfinite(weights).all()),
                "weights": weights.tolist(), "replica_spread": replica_spread(model)}
    finally:
        keras.mixed_precision.set_global_policy("float32")


def replica_spread(model):
    """Largest difference between the local replicas' copies of any weight."""
    spread = 0.0
    for w in model.weights:
        parts = getattr(getattr(w, "value", w), "values", None) or ()
        for part in parts[1:]:
            spread = max(spread, float(np.max(np.abs(np.asarray(part) - np.asarray(parts[0])))))
    return spread


def in_bn_stats(model):
    try:
        layer = model.get_layer("in_bn")
    except ValueError:
        return {}
    return {"inbn_mean": np.asarray(layer.moving_mean), "inbn_var": np.asarray(layer.moving_variance)}


def weights_of(model):
    return {f"w{i}": np.asarray(v) for i, v in enumerate(model.get_weights())}


def phase_mismatches(rank):
    """Rank-dependent epochs, an evaluate on rank 0 only, a stop on rank 1
    only: each fails on every worker at the boundary, in Keras' terms,
    within seconds, and the job goes on (a last fit agrees)."""
    import time as _time
    from bps_tf.strategy.phases import PhaseMismatchError
    strategy = new_strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.ones((32, 4), "float32")
    y = np.zeros((32, 3), "float32")
    # The stop's boundary is the first epoch's end, not the fit's start:
    # the epoch (tracing the train step, on a loaded machine several
    # seconds) is not the check's delay. CLOCK_MONOTONIC is one clock for
    # the workers of this machine, so the test compares their times.
    epoch_ended = {}

    def stop_on_rank_1(epoch, logs):
        epoch_ended.setdefault("at", _time.monotonic())
        model.stop_training = rank == 1 and epoch == 0

    out = {}
    for name, run in (
            ("epochs", lambda: model.fit(x, y, batch_size=8, epochs=1 + rank, verbose=0)),
            ("evaluate", lambda: (model.evaluate(x, y, batch_size=8, verbose=0) if rank == 0
                                  else model.fit(x, y, batch_size=8, epochs=1, verbose=0))),
            # A callback stops training on one worker only (a rank-dependent EarlyStopping).
            ("stop", lambda: model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[
                keras.callbacks.LambdaCallback(on_epoch_end=stop_on_rank_1)]))):
        # Timed from when both workers are here: the divergence starts when
        # the later one reaches the boundary, not when a faster one waits.
        bps_tf.barrier()
        started = _time.monotonic()
        try:
            run()
            out[name] = {"error": None}
        except PhaseMismatchError as exc:
            raised = _time.monotonic()
            out[name] = {"error": str(exc), "seconds": raised - started,
                         "boundary_at": epoch_ended.get("at", started), "raised_at": raised}
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)    # every worker alike again
    return out


def drift_checks(rank):
    """Replicas that are not the same model: refused or caught (fingerprints
    every BYTEPS_FINGERPRINT_STEPS=4 steps, set by test_strategy.py)."""
    from bps_tf.comm.fingerprint import ReplicasDriftedError
    out = {}
    # Two user-named layers built in another order on each worker.
    try:
        with new_strategy().scope():
            first, second = ("encoder", "decoder") if rank == 0 else ("decoder", "encoder")
            keras.layers.Dense(4, name=first).build((None, 4))
            keras.layers.Dense(4, name=second).build((None, 4))
        out["build_order"] = None
    except Exception as exc:  # the scheduler's error, on every worker
        out["build_order"] = str(exc)
    x = np.random.RandomState(3).randn(64, 4).astype("float32")
    y = x[:, :2] * 2.0

    class Perturb(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if rank == 1 and batch == 1:
                kernel = self.model.layers[0].kernel
                kernel.assign(kernel + 1e-3)
    strategy = new_strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    try:
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[Perturb()])
        out["fit_perturbed"] = None
    except ReplicasDriftedError as exc:
        out["fit_perturbed"] = str(exc)
    # Fits shorter than the interval (3 batches, BYTEPS_FINGERPRINT_STEPS=4):
    # the batches count across fits, and each fit ends with a check.
    with new_strategy().scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    try:
        model.fit(x[:48], y[:48], batch_size=16, epochs=1, verbose=0)
        model.fit(x[:48], y[:48], batch_size=16, epochs=1, verbose=0, callbacks=[Perturb()])
        out["short_fits"] = None
    except ReplicasDriftedError as exc:
        out["short_fits"] = str(exc)
    # sync_state=False: each replica keeps its own BatchNormalization
    # statistics (different data, different statistics): not a drift. The
    # weights are still compared.
    with new_strategy(sync_state=False).scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                  keras.layers.BatchNormalization(), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    try:
        model.fit(x + rank, y, batch_size=16, epochs=2, verbose=0)
        out["sync_state_off"] = None
    except ReplicasDriftedError as exc:
        out["sync_state_off"] = str(exc)
    try:
        model.fit(x + rank, y, batch_size=16, epochs=1, verbose=0, callbacks=[Perturb()])
        out["sync_state_off_perturbed"] = None
    except ReplicasDriftedError as exc:
        out["sync_state_off_perturbed"] = str(exc)
    for case in ("tape_skipped", "optimizer_skipped"):
        keras.utils.set_random_seed(4)
        dense = keras.layers.Dense(2)
        dense.build((None, 4))
        bps_tf.broadcast_variables(dense.trainable_variables, root_rank=0)
        sgd = keras.optimizers.SGD(0.1)
        opt = bps_tf.DistributedOptimizer(keras.optimizers.SGD(0.1))
        try:
            for step in range(8):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((dense(x[:8]) - y[:8]) ** 2)
                skip = rank == 1 and step == 2      # its own gradient, no exchange
                if case == "tape_skipped":
                    grads = (tape if skip else bps_tf.DistributedGradientTape(tape)).gradient(
                        loss, dense.trainable_variables)
                    sgd.apply(grads, dense.trainable_variables)
                else:
                    grads = tape.gradient(loss, dense.trainable_variables)
                    (sgd if skip else opt).apply(grads, dense.trainable_variables)
            out[case] = None
        except ReplicasDriftedError as exc:
            out[case] = str(exc)
    return out


def new_strategy(**options):
    return BytePSStrategy(devices=["/cpu:0", "/cpu:1"], **options)


def bps_mirrored(out_dir, rank, x, y, report):
    """bps_tf.distribute.MirroredStrategy (BytePS's): each worker feeds its own
    batches. Worker r trains on rows [16k + 8r, 16k + 8r + 8) as its batch k
    (batch_size 8), from the sgd scenario's initial weights: the two workers'
    batches k together are the sgd reference's global batch k."""
    entry = report["scenarios"].setdefault("bps_mirrored", {})
    started = time.time()
    try:
        strategy = bps_tf.distribute.MirroredStrategy(devices=["/cpu:0", "/cpu:1"])
        entry["replicas"] = strategy.num_replicas_in_sync
        with strategy.scope():
            model = make_model(0.0)
            compile_model(model, "sgd")
        start = np.load(os.path.join(out_dir, f"sgd.rank{rank}.npz"))
        model.set_weights([start[f"init_w{i}"] for i in range(len(model.weights))])
        rows = np.array([i for i in range(N_TRAIN) if (i // 8) % 2 == rank])
        model.fit({k: v[rows] for k, v in x.items()}, y[rows], batch_size=8, epochs=EPOCHS,
                  shuffle=False, verbose=0)
        x10 = {k: v[:PREDICT_ROWS] for k, v in x.items()}
        entry["predict_rows"] = int(model.predict(x10, batch_size=4, verbose=0).shape[0])
        np.savez(os.path.join(out_dir, f"bps_mirrored.rank{rank}.npz"), **weights_of(model))
        entry["ok"] = True
    except Exception as exc:  # recorded, asserted by the test
        entry["ok"] = False
        entry["error"] = f"{exc}\n{traceback.format_exc()[-4000:]}"
    entry["seconds"] = time.time() - started


def main(out_dir):
    keras.utils.set_random_seed(0)
    strategy = new_strategy()
    rank, size = bps_tf.rank(), bps_tf.size()
    report = {"rank": rank, "size": size, "replicas": strategy.num_replicas_in_sync,
              "should_checkpoint": strategy.extended.should_checkpoint,
              "resolver": [strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id],
              "scenarios": {}}
    (x, y), (xv, yv) = make_data()
    try:
        report["primitives"] = primitives(strategy, rank)
    except Exception as exc:  # recorded, asserted by the test
        report["primitives"] = {"error": f"{exc}\n{traceback.format_exc()[-4000:]}"}

    # Workers that disagree on BYTEPS_EARLY_DATA_CHECK would wait for sums
    # the others never start: the strategy refuses to start.
    os.environ["BYTEPS_EARLY_DATA_CHECK"] = "1" if rank == 0 else "0"
    try:
        new_strategy()
        report["early_check_vote"] = ""
    except ValueError as exc:
        report["early_check_vote"] = str(exc)
    finally:
        del os.environ["BYTEPS_EARLY_DATA_CHECK"]
    # Workers with different local device counts would divide by different
    # replica counts: refused on every worker, naming each rank's count.
    try:
        BytePSStrategy(devices=["/cpu:0", "/cpu:1"] if rank == 0 else ["/cpu:0"])
        report["device_count_vote"] = ""
    except ValueError as exc:
        report["device_count_vote"] = str(exc)
    try:
        report["uneven_data"] = uneven_data(strategy, rank)
    except Exception as exc:  # recorded, asserted by the test
        report["uneven_data"] = {"error": f"{exc}\n{traceback.format_exc()[-4000:]}"}
    try:
        report["own_datasets"] = own_datasets(rank)
    except Exception as exc:  # recorded, asserted by the test
        report["own_datasets"] = {"error": f"{exc}\n{traceback.format_exc()[-4000:]}"}
    for poisoned in (False, True):
        try:
            report[f"mixed_precision_{poisoned}"] = mixed_precision(rank, poisoned)
        except Exception as exc:  # recorded, asserted by the test
            report[f"mixed_precision_{poisoned}"] = {
                "error": f"{exc}\n{traceback.format_exc()[-4000:]}"}

    def write():
        with open(os.path.join(out_dir, f"rank{rank}.json.tmp"), "w") as f:
            json.dump(report, f)
        os.replace(os.path.join(out_dir, f"rank{rank}.json.tmp"),
                   os.path.join(out_dir, f"rank{rank}.json"))

    for name, optimizer, dropout, compared in SCENARIOS:
        entry = report["scenarios"].setdefault(name, {})
        started = time.time()
        try:
            # A strategy per scenario: its gradient priorities are this
            # scenario's alone (and several strategies in one process work).
            strategy = new_strategy(**STRATEGY_OPTIONS.get(name, {}))
            with strategy.scope():
                model = make_model(dropout, **MODEL_OPTIONS.get(name, {}))
                compile_model(model, optimizer)
            initial = weights_of(model)
            saves = []
            callbacks = [Recorder(saves)]
            if name == "sgd":
                callbacks.append(keras.callbacks.ModelCheckpoint(
                    os.path.join(out_dir, "ckpt.weights.h5"), save_weights_only=True))
            validation = (xv, yv) if compared else None
            history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                                validation_data=validation, callbacks=callbacks, verbose=0)
            entry["history"] = {k: [float(v) for v in vs] for k, vs in history.history.items()}
            if compared:
                entry["evaluate"] = [float(v) for v in
                                     model.evaluate(xv, yv, batch_size=GLOBAL_BATCH, verbose=0)]
            entry["saves"] = saves
            preds = gather_predictions(model, xv, batch_size=8) if compared else np.zeros(0)
            x10 = {k: v[:PREDICT_ROWS] for k, v in xv.items()}
            predicted = {"predict10": model.predict(x10, batch_size=4, verbose=0)}
            if name == "sgd":     # fewer rows than workers: rank 1 predicts none
                predicted["predict1"] = model.predict({k: v[:1] for k, v in xv.items()},
                                                      verbose=0)
            entry["replica_spread"] = replica_spread(model)
            np.savez(os.path.join(out_dir, f"{name}.rank{rank}.npz"),
                     preds=preds, **{f"init_{k}": v for k, v in initial.items()},
                     **weights_of(model), **predicted, **in_bn_stats(model))
            entry["priorities"] = strategy.extended._push_pull_ops.gradient_priorities()
            entry["ok"] = True
        except Exception as exc:  # recorded, asserted by the test
            entry["ok"] = False
            entry["error"] = f"{exc}\n{traceback.format_exc()[-4000:]}"
        entry["seconds"] = time.time() - started
        write()

    bps_mirrored(out_dir, rank, x, y, report)
    write()
    # Last of the collective checks: they end fits early on purpose.
    try:
        report["drift"] = drift_checks(rank)
    except Exception as exc:  # recorded, asserted by the test
        report["drift"] = {"error": f"{exc}\n{traceback.format_exc()[-4000:]}"}
    try:
        report["phases"] = phase_mismatches(rank)
    except Exception as exc:  # recorded, asserted by the test
        report["phases"] = {"error": f"{exc}\n{traceback.format_exc()[-4000:]}"}
    write()

    # References, spread over the workers (they run side by side).
    references = [s for s in SCENARIOS if s[3] and report["scenarios"][s[0]].get("ok")]
    for name, optimizer, dropout, _ in references[rank::size]:
        started = time.time()
        result = {}
        try:
            start = np.load(os.path.join(out_dir, f"{name}.rank{rank}.npz"))
            model = make_model(dropout, **MODEL_OPTIONS.get(name, {}))
            compile_model(model, optimizer)
            model.set_weights([start[f"init_w{i}"] for i in range(len(model.weights))])
            history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                                validation_data=(xv, yv), verbose=0)
            result["history"] = {k: [float(v) for v in vs] for k, vs in history.history.items()}
            result["evaluate"] = [float(v) for v in model.evaluate(
                xv, yv, batch_size=GLOBAL_BATCH, verbose=0)]
            np.savez(os.path.join(out_dir, f"{name}.reference.npz"),
                     preds=model.predict(xv, verbose=0), **weights_of(model),
                     **in_bn_stats(model))
        except Exception as exc:  # recorded, asserted by the test
            result["error"] = f"{exc}\n{traceback.format_exc()[-4000:]}"
        result["seconds"] = time.time() - started
        with open(os.path.join(out_dir, f"{name}.reference.json"), "w") as f:
            json.dump(result, f)
    # A plain model (no strategy) with the distributed sgd model's final
    # weights: what model.predict on one process returns.
    if report["scenarios"]["sgd"].get("ok"):
        final = np.load(os.path.join(out_dir, f"sgd.rank{rank}.npz"))
        model = make_model(0.0)
        model.set_weights([final[f"w{i}"] for i in range(len(model.weights))])
        x10 = {k: v[:PREDICT_ROWS] for k, v in xv.items()}
        np.save(os.path.join(out_dir, f"sgd.plain_predict.rank{rank}.npy"),
                model.predict(x10, batch_size=3, verbose=0))
    report["done"] = True
    write()


if __name__ == "__main__":
    main(sys.argv[1])
