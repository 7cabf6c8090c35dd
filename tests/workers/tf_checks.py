"""Worker script for test_tf_multiworker.py: many checks in one cluster.

    bpslaunch -np 3 --servers 2 python tests/workers/tf_checks.py OUT_DIR

Every worker runs the same checks in the same order (each is a collective)
and writes OUT_DIR/rank<r>.json: {"size": n, "checks": {name: {"ok", "detail"}}}.
The file is written after every check. A failed check ends the worker at
once (exit 3): the other workers would otherwise wait for collectives it
never issues, and bpslaunch stops the whole job on the first failure.
The shape- and root-mismatch checks run last: they leave errors behind in the cluster.

Values are integers that depend on the rank, so sums are exact in every
dtype and a wrong or missing contribution changes the result.
"""
import os
import sys

import numpy as np
import tensorflow as tf
import keras

import bps_tf
from bps_tf.horovod import api
from bps_tf.runtime import basics, config
from bps_tf.horovod.tape import DistributedGradientTape
import bps_tf.keras as bps_keras
import join_checks
import parity_checks
from check_record import Checks  # noqa: E402

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64]


def expect_equal(what, got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or not np.array_equal(got, want):
        bad = np.argwhere(got != want)[:3].tolist() if got.shape == want.shape else "shape"
        raise AssertionError(f"{what}: got {got.dtype}{list(got.shape)}, want "
                             f"{want.dtype}{list(want.shape)}, first differences at {bad}")


# --------------------------------------------------------------------------
def rank_values(n, dtype, rank):
    """(i % 5) * (rank + 1) + rank: small integers, exact in every dtype."""
    base = np.arange(n, dtype=np.int64) % 5
    return tf.cast(base * (rank + 1) + rank, dtype)


def expected_sum(n, size):
    base = np.arange(n, dtype=np.int64) % 5
    return base * (size * (size + 1) // 2) + size * (size - 1) // 2


def element_counts(dtype, partition_bytes):
    item = dtype.size
    return {"0": 0, "1": 1, "7": 7, "1MiB": (1 << 20) // item,
            "3parts+1": 3 * partition_bytes // item + 1}


def check_push_pull_dtypes(rank, size, partition_bytes):
    done = []
    for dtype in DTYPES:
        for label, n in element_counts(dtype, partition_bytes).items():
            x = rank_values(n, dtype, rank)
            summed = api.push_pull(x, op=api.Sum, name=f"dtypes/{dtype.name}/{label}/sum")
            want = expected_sum(n, size)
            expect_equal(f"sum {dtype.name} {label}", summed.numpy().astype(np.float64),
                         want.astype(np.float64))
            assert summed.dtype == dtype, summed.dtype
            averaged = api.push_pull(x, op=api.Average, name=f"dtypes/{dtype.name}/{label}/avg")
            if dtype.is_integer:
                want_avg = np.floor_divide(want, size)
            else:   # exact here: the sums are multiples of size
                want_avg = want / size
            expect_equal(f"average {dtype.name} {label}",
                         averaged.numpy().astype(np.float64), want_avg.astype(np.float64))
            assert averaged.dtype == dtype, averaged.dtype
            done.append(f"{dtype.name}:{label}={n}")
    return " ".join(done)


def check_fifty_in_flight(rank, size):
    shapes = [[(i % 7) + 1, (i % 3) + 2] for i in range(50)]
    dtypes = [DTYPES[i % len(DTYPES)] for i in range(50)]

    @tf.function(autograph=False)
    def all_at_once():
        # Independent ops in one graph: all 50 are enqueued before any returns.
        return [api.push_pull(tf.reshape(rank_values(int(np.prod(s)), d, rank), s),
                              op=api.Sum, name=f"inflight/{i}")
                for i, (s, d) in enumerate(zip(shapes, dtypes))]

    outs = all_at_once()
    for i, (out, s) in enumerate(zip(outs, shapes)):
        want = expected_sum(int(np.prod(s)), size).reshape(s)
        expect_equal(f"inflight/{i}", out.numpy().astype(np.float64), want.astype(np.float64))
    return "50 ok"


def check_broadcast_from_rank1(rank, size, partition_bytes):
    for dtype in DTYPES:
        n = 3 * partition_bytes // dtype.size + 1
        got = api.broadcast(rank_values(n, dtype, rank), root_rank=1, name=f"bcast/{dtype.name}")
        expect_equal(f"broadcast {dtype.name}", got.numpy().astype(np.float64),
                     rank_values(n, dtype, 1).numpy().astype(np.float64))
    flags = api.broadcast(tf.constant([rank == 1, rank != 1]), root_rank=1, name="bcast/bool")
    expect_equal("broadcast bool", flags.numpy(), [True, False])
    obj = api.broadcast_object({"from": rank, "text": "x" * (rank * 7 + 1)}, root_rank=1,
                               name="bcast/object")
    assert obj == {"from": 1, "text": "x" * 8}, obj
    return "ok"


def check_fp16_compression_and_unnamed_calls(rank, size):
    n = 1000
    x = tf.cast(rank_values(n, tf.int32, rank), tf.float32)
    got = api.push_pull(x, op=api.Sum, compression=api.Compression.fp16, name="fp16")
    assert got.dtype == tf.float32, got.dtype
    expect_equal("fp16 compressed sum", got.numpy(), expected_sum(n, size).astype(np.float32))
    # Each worker's values fit float16, their sum does not: scaled, never inf.
    big = tf.fill([5], 40000.0 + rank)
    got = api.push_pull(big, op=api.Sum, compression=api.Compression.fp16, name="fp16/big")
    want = 40000.0 * size + size * (size - 1) / 2
    assert np.all(np.isfinite(got.numpy())), got.numpy()
    assert np.allclose(got.numpy(), want, rtol=2.0 ** -9, atol=0), (got.numpy(), want)
    # Unnamed eager calls are numbered per process: same order, same names.
    for i in range(3):
        got = api.push_pull(tf.constant([float(rank + i)]), op=api.Sum)
        expect_equal(f"unnamed call {i}", got.numpy(), [float(size * i + size * (size - 1) // 2)])
    return "ok"


def _seeded_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])


def check_broadcast_variables_from_rank1(rank, size):
    model = _seeded_model(100 + rank)   # different start on every worker
    expected = [w.copy() for w in _seeded_model(101).get_weights()]
    counter = tf.Variable(rank * 10, dtype=tf.int64, name="counter")
    # Same paths on every worker: the second model used the same auto-names.
    api.broadcast_variables(model.variables + [counter], root_rank=1)
    for got, want in zip(model.get_weights(), expected):
        expect_equal("broadcast_variables", got, want)
    assert int(counter.numpy()) == 10, int(counter.numpy())
    return "ok"


def check_allgather(rank, size):
    cases = {"growing": [r + 1 for r in range(size)],
             "with_empty": [0] + [3] * (size - 1)}
    for label, rows_per_rank in cases.items():
        for dtype in DTYPES:
            def rows_of(r):
                return tf.cast(tf.reshape(r * 100 + tf.range(rows_per_rank[r] * 2), [-1, 2]), dtype)
            got = api.allgather(rows_of(rank), name=f"gather/{label}/{dtype.name}")
            want = np.concatenate([rows_of(r).numpy() for r in range(size)])
            expect_equal(f"allgather {label} {dtype.name}", got.numpy(), want)

    @tf.function
    def in_graph(x):
        return api.allgather(x, name="gather/graph")

    got = in_graph(tf.fill([rank + 2, 3], float(rank)))
    want = np.concatenate([np.full([r + 2, 3], float(r), np.float32) for r in range(size)])
    expect_equal("allgather in tf.function", got.numpy(), want)
    return "ok"


# --------------------------------------------------------------------------
def _training_data(steps, global_batch, seed=7):
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, 20, size=(steps, global_batch, 3)).astype("int32")
    y = rng.randn(steps, global_batch, 1).astype("float32")
    return ids, y


def _sparse_model(seed=5):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(20, 4),
                             keras.layers.Flatten(), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def check_tape_training_matches_single_process(rank, size):
    """Each worker trains on its slice of every global batch; the result must
    equal one process training on the whole batches."""
    steps, per_worker = 8, 6
    ids, y = _training_data(steps, per_worker * size)
    loss_fn = keras.losses.MeanSquaredError()

    def train(model, distributed):
        opt = keras.optimizers.SGD(0.1, momentum=0.5)
        opt.build(model.trainable_variables)

        @tf.function
        def step(x, t):
            with tf.GradientTape() as tape:
                loss = loss_fn(t, model(x))
            if distributed:
                tape = DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        for s in range(steps):
            if distributed:
                part = slice(rank * per_worker, (rank + 1) * per_worker)
                step(ids[s, part], y[s, part])
            else:
                step(ids[s], y[s])
        return model.get_weights()

    reference = train(_sparse_model(), distributed=False)
    # Only rank 0 starts from the reference's weights; the broadcast fixes the others.
    model = _sparse_model(seed=5 if rank == 0 else 50 + rank)
    api.broadcast_variables(model.variables, root_rank=0)
    distributed = train(model, distributed=True)
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(reference, distributed))
    if worst > 1e-5:
        raise AssertionError(f"distributed weights differ from the single-process ones by {worst}")
    start = _sparse_model().get_weights()
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(start, distributed))
    assert moved > 1e-3, f"training did not change the weights ({moved})"
    return f"max difference {worst:.2e}"


def check_fit_with_distributed_optimizer(rank, size):
    """model.fit on each worker's own data: all workers end identical, equal to
    one process fitting the interleaved global batches."""
    steps, per_worker = 6, 8
    rng = np.random.RandomState(11)
    x = rng.randn(steps, size, per_worker, 5).astype("float32")
    y = (x.sum(-1, keepdims=True) * 0.3).astype("float32")

    def dense_model(seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="relu"),
                                 keras.layers.Dense(1)])

    model = dense_model(200 + rank)
    start = api.broadcast_object(model.get_weights() if rank == 0 else None, root_rank=0,
                                 name="fit/start")
    opt = bps_keras.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    history = model.fit(
        x[:, rank].reshape(-1, 5), y[:, rank].reshape(-1, 1), batch_size=per_worker,
        epochs=2, shuffle=False, verbose=0,
        callbacks=[bps_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                   bps_keras.callbacks.MetricAverageCallback()])
    weights = model.get_weights()

    root_weights = api.broadcast_object(weights, root_rank=0, name="fit/weights")
    for got, want in zip(weights, root_weights):
        expect_equal("weights equal to rank 0's", got, want)
    root_loss = api.broadcast_object(history.history["loss"], root_rank=0, name="fit/loss")
    assert history.history["loss"] == root_loss, (history.history["loss"], root_loss)

    reference = dense_model(0)
    reference.set_weights(start)
    reference.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse",
                      jit_compile=False)
    reference.fit(x.reshape(-1, 5), y.reshape(-1, 1), batch_size=per_worker * size,
                  epochs=2, shuffle=False, verbose=0)
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, reference.get_weights()))
    if worst > 1e-5:
        raise AssertionError(f"fit weights differ from the single-process fit by {worst}")
    return f"max difference {worst:.2e}"


def check_mixed_precision_distributed_optimizer(rank, size):
    """Keras 3 under mixed_float16 wraps the DistributedOptimizer in a
    LossScaleOptimizer, whose inf/nan check sees each worker's own gradients:
    an overflow on rank 0 alone must skip that step on every worker."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        rng = np.random.RandomState(rank)
        x = rng.randn(32, 5).astype("float32")
        y = rng.randn(32, 1).astype("float32")
        if rank == 0:
            x[8:10] *= 1e5                     # step 1 overflows on rank 0 only
        keras.utils.set_random_seed(4)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="relu"),
                                  keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer=bps_keras.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                      loss="mse", jit_compile=False)
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0,
                  callbacks=[bps_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
        optimizer = model.optimizer
        state = {"class": type(optimizer).__name__, "iterations": int(optimizer.iterations.numpy()),
                 "scale": float(optimizer.dynamic_scale.numpy()),
                 "initial": float(optimizer.initial_scale)}
        if state != {"class": "LossScaleOptimizer", "iterations": 3,
                     "scale": state["initial"] / 2, "initial": state["initial"]}:
            raise AssertionError(f"expected one skipped step of 4 and a halved scale: {state}")
        weights = model.get_weights()
        for got, want in zip(weights, api.broadcast_object(weights, root_rank=0,
                                                           name="mixed/weights")):
            expect_equal("weights equal to rank 0's", got, want)
        if not all(np.isfinite(w).all() for w in weights):
            raise AssertionError("non-finite weights")
        return f"iterations {state['iterations']} scale {state['scale']:g}"
    finally:
        keras.mixed_precision.set_global_policy("float32")


def check_shape_mismatch_is_reported(rank, size):
    """Horovod's error type on every rank; then the same name, now agreed on,
    works (a refused declaration is not kept)."""
    try:
        api.push_pull(tf.zeros([rank + 2]), op=api.Sum, name="mismatch/w")
    except tf.errors.FailedPreconditionError as exc:   # as Horovod raises it
        message = str(exc)
    else:
        raise AssertionError("push_pull of different shapes under one name did not fail")
    again = api.push_pull(tf.ones([2 + rank % 1]), op=api.Sum, name="mismatch/w")
    if again.numpy().tolist() != [float(size)] * 2:
        raise AssertionError(f"the name after a mismatch: {again.numpy()}")
    return message


def check_broadcast_root_mismatch_is_reported(rank, size):
    try:
        api.broadcast(tf.constant([float(rank)]), root_rank=0 if rank == 0 else 1,
                      name="mismatch/root")
    except tf.errors.FailedPreconditionError as exc:   # the scheduler's, on every rank
        return str(exc)
    raise AssertionError("broadcast with different roots under one name did not fail")


def check_strategy_fp16_compression(rank, size):
    """BytePSStrategy(compression=fp16): an optimizer's gradients travel as
    float16 (the step shows float16 rounding), scaled so that gradients
    that fit float16 but whose sum does not stay finite; small ones stay
    exact; the user's own reductions (strategy.reduce) are never compressed;
    a DistributedOptimizer's own compression under the strategy is refused."""
    from bps_tf.strategy import BytePSStrategy
    strategy = BytePSStrategy(compression=api.Compression.fp16)

    def summed_gradient(tag, value, n):
        """-(the variable after one SGD(1) step from 0) = the summed gradient."""
        with strategy.scope():   # one name on every worker: variables are matched by it
            var = keras.Variable(np.zeros([n], np.float32), name=f"fp16_{tag}")
            opt = keras.optimizers.SGD(1.0)
            opt.build([var])

        @tf.function
        def step():
            strategy.run(lambda: opt.apply_gradients([(tf.fill([n], value), var)]))
        step()
        return -var.numpy()

    want = 40000.0 * size + size * (size - 1) / 2
    got = summed_gradient("big", 40000.0 + rank, 2048)   # each fits float16, the sum does not
    assert np.all(np.isfinite(got)) and np.allclose(got, want, rtol=2.0 ** -9, atol=0), got[:4]
    # Values float16 cannot hold exactly: the summed gradient shows its rounding.
    values = [np.float32(1.0 / 3.0 + 0.1 * (r + 1)) for r in range(size)]
    exact = np.float32(sum(np.float64(v) for v in values))
    got = summed_gradient("uneven", float(values[rank]), 2048)
    assert abs(got[0] - exact) > exact * 2.0 ** -20, (got[0], exact, "not compressed")
    assert abs(got[0] - exact) <= exact * 2.0 ** -9, (got[0], exact)
    got = summed_gradient("small", 1.0 / 3.0, 10)          # under 1,024 elements: not compressed
    assert np.allclose(got, np.float32(1.0 / 3.0) * size, rtol=2.0 ** -20, atol=0), got
    # The user's own reduction of the same values: float32 all the way.
    uneven = strategy.run(lambda: tf.fill([2048], values[rank]))
    got = strategy.reduce(tf.distribute.ReduceOp.SUM, uneven, axis=None).numpy()
    assert abs(got[0] - exact) <= exact * 2.0 ** -20, (got[0], exact, "compressed")
    from bps_tf.keras import DistributedOptimizer
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        opt = DistributedOptimizer(keras.optimizers.SGD(0.1),
                                   compression=api.Compression.fp16)
        model.compile(optimizer=opt, loss="mse")
    try:
        model.fit(np.ones((12, 3), np.float32), np.ones((12, 2), np.float32), epochs=1,
                  batch_size=6, verbose=0)
    except ValueError as exc:
        assert "Pass it to the strategy instead" in str(exc), exc
    else:
        raise AssertionError("DistributedOptimizer(compression=fp16) under the strategy "
                             "was silently ignored")
    return "ok"


def main(out_dir):
    bps_tf.init()
    rank, size = bps_tf.rank(), bps_tf.size()
    partition_bytes = config.value("BYTEPS_PARTITION_BYTES")
    checks = Checks(out_dir, rank, size)
    checks.results["partition_bytes"] = {"ok": True, "detail": str(partition_bytes)}
    checks.results["heap_keeps_buffers"] = {
        "ok": True, "detail": str(basics.stats()["heap_keeps_buffers"])}
    checks.run("push_pull_dtypes", lambda: check_push_pull_dtypes(rank, size, partition_bytes))
    checks.run("fifty_in_flight", lambda: check_fifty_in_flight(rank, size))
    checks.run("fp16_and_unnamed", lambda: check_fp16_compression_and_unnamed_calls(rank, size))
    checks.run("broadcast_from_rank1",
               lambda: check_broadcast_from_rank1(rank, size, partition_bytes))
    checks.run("broadcast_variables_from_rank1",
               lambda: check_broadcast_variables_from_rank1(rank, size))
    checks.run("allgather", lambda: check_allgather(rank, size))
    checks.run("tape_training", lambda: check_tape_training_matches_single_process(rank, size))
    checks.run("fit_distributed_optimizer",
               lambda: check_fit_with_distributed_optimizer(rank, size))
    checks.run("mixed_precision", lambda: check_mixed_precision_distributed_optimizer(rank, size))
    parity_checks.run_all(checks, rank, size)
    join_checks.run_all(checks, rank, size)
    checks.run("strategy_fp16", lambda: check_strategy_fp16_compression(rank, size))
    checks.run("shape_mismatch", lambda: check_shape_mismatch_is_reported(rank, size))
    checks.run("root_mismatch", lambda: check_broadcast_root_mismatch_is_reported(rank, size))
    checks.results["finished"] = {"ok": True, "detail": ""}
    checks.write()


if __name__ == "__main__":
    main(sys.argv[1])
