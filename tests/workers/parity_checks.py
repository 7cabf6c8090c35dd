"""Horovod-parity checks, run by tests/workers/tf_checks.py in its cluster.

Every dtype Horovod supports through allreduce (Sum, Average, Min, Max,
Product), allgather, broadcast, reducescatter and alltoall (bool through
broadcast, allgather and alltoall), plus barrier, broadcast_ and
SyncBatchNormalization. Expectations are computed with numpy from every
rank's inputs (each worker can rebuild any rank's values), exactly: narrow
integer sums and products must wrap as their type does.
"""
import time

import numpy as np
import tensorflow as tf
import keras

import bps_tf
import bps_tf.keras  # noqa: F401  (bps_tf.keras.callbacks)
from bps_tf.horovod import api
import gradient_checks

INTS = [tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64]
FLOATS = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
DTYPES = INTS + FLOATS


def expect_equal(what, got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or not np.array_equal(got, want):
        raise AssertionError(f"{what}: got {got.tolist()} ({got.dtype}{list(got.shape)}), "
                             f"want {want.tolist()} ({want.dtype}{list(want.shape)})")


def as_numpy(tensor):
    """A tensor's values as float64 (floats) or int64 (ints), bool as is."""
    value = tensor.numpy()
    if tensor.dtype == tf.bool:
        return value
    return value.astype(np.int64 if tensor.dtype.is_integer else np.float64)


def wrap(values, dtype):
    """int64 values as ``dtype`` would hold them (wrapping), back in int64."""
    if not dtype.is_integer:
        return np.asarray(values, np.float64)
    return np.asarray(values, np.int64).astype(dtype.as_numpy_dtype).astype(np.int64)


def sum_values(rank, dtype):
    """Per-rank inputs whose sum over 2+ ranks overflows the narrow types."""
    if dtype == tf.uint8:
        v = [200, 100 + rank, 255, rank, 7]
    elif dtype == tf.int8:
        v = [100, -100, 127, -128 + rank, rank - 1]
    elif dtype == tf.uint16:
        v = [60000, 40000 + rank, 65535, rank, 7]
    elif dtype == tf.int16:
        v = [30000, -30000, 32767, -32768 + rank, rank - 1]
    else:   # exact in every float type
        v = [rank + 1, -3 * (rank + 1), 5, 2 * rank, 0]
    return np.asarray(v, np.int64)


def small_values(rank, dtype):
    """Per-rank inputs for Min/Max/Product (products wrap the 8-bit types)."""
    if dtype.is_unsigned:
        v = [rank + 1, 16 * (rank + 1), 9 - rank, 3]
    else:
        v = [rank + 1, -16 * (rank + 1), 9 - rank, -(rank % 2) - 1]
    return np.asarray(v, np.int64)


def check_allreduce_every_dtype_and_op(rank, size):
    done = []
    for dtype in DTYPES:
        every = np.stack([sum_values(r, dtype) for r in range(size)])
        x = tf.constant(sum_values(rank, dtype), dtype)
        got = api.allreduce(x, op=api.Sum, name=f"parity/sum/{dtype.name}")
        assert got.dtype == dtype
        expect_equal(f"sum {dtype.name}", as_numpy(got), wrap(every.sum(0), dtype))
        got = api.allreduce(x, op=api.Average, name=f"parity/avg/{dtype.name}")
        if dtype.is_integer and dtype.size < 4:   # floor of the exact mean
            want = np.floor_divide(every.sum(0), size)
        elif dtype.is_integer:
            want = np.floor_divide(wrap(every.sum(0), dtype), size)
        else:
            want = every.sum(0) / size
        tol = 1e-2 if dtype.size == 2 and not dtype.is_integer else 1e-12
        if dtype.is_integer:
            expect_equal(f"average {dtype.name}", as_numpy(got), want)
        elif not np.allclose(as_numpy(got), want, rtol=tol, atol=tol):
            raise AssertionError(f"average {dtype.name}: {as_numpy(got)} != {want}")
        small = np.stack([small_values(r, dtype) for r in range(size)])
        x = tf.constant(small_values(rank, dtype), dtype)
        for op, fn in ((api.Min, np.min), (api.Max, np.max), (api.Product, np.prod)):
            got = api.allreduce(x, op=op, name=f"parity/{op.name}/{dtype.name}")
            assert got.dtype == dtype
            expect_equal(f"{op.name} {dtype.name}", as_numpy(got), wrap(fn(small, 0), dtype))
        done.append(dtype.name)
    # int32 sums wrap too (the servers sum in the tensor's type)
    got = api.allreduce(tf.constant([2 ** 31 - 1, -2 ** 31], tf.int32), op=api.Sum,
                        name="parity/sum/int32_wrap")
    expect_equal("int32 wrap", as_numpy(got),
                 wrap(np.asarray([2 ** 31 - 1, -2 ** 31], np.int64) * size, tf.int32))

    @tf.function
    def in_graph(a, b):
        return (api.allreduce(a, op=api.Sum, name="parity/graph/sum"),
                api.allreduce(b, op=api.Max, name="parity/graph/max"))

    s, m = in_graph(tf.constant(sum_values(rank, tf.uint8), tf.uint8),
                    tf.constant(small_values(rank, tf.int16), tf.int16))
    expect_equal("graph sum uint8", as_numpy(s),
                 wrap(sum(sum_values(r, tf.uint8) for r in range(size)), tf.uint8))
    expect_equal("graph max int16", as_numpy(m),
                 np.max([small_values(r, tf.int16) for r in range(size)], 0))
    return " ".join(done)


def gather_rows(rank, dtype, rows):
    values = (np.arange(rows * 2, dtype=np.int64).reshape(rows, 2) + 10 * rank) % 50
    return values % 2 == 0 if dtype == tf.bool else values


def check_allgather_and_broadcast_every_dtype(rank, size):
    for dtype in DTYPES + [tf.bool]:
        for label, rows in (("growing", lambda r: r + 1), ("first_empty", lambda r: 2 * r)):
            got = api.allgather(tf.constant(gather_rows(rank, dtype, rows(rank)), dtype),
                                name=f"parity/gather/{label}/{dtype.name}")
            assert got.dtype == dtype
            want = np.concatenate([gather_rows(r, dtype, rows(r)) for r in range(size)])
            expect_equal(f"allgather {label} {dtype.name}", as_numpy(got), want)
        mine = tf.constant(gather_rows(rank, dtype, 3), dtype)
        got = api.broadcast(mine, root_rank=1, name=f"parity/bcast/{dtype.name}")
        expect_equal(f"broadcast {dtype.name}", as_numpy(got), gather_rows(1, dtype, 3))
    got = bps_tf.grouped_allgather([tf.constant([rank], tf.int8), tf.constant([rank == 0])],
                                   name="parity/grouped")
    expect_equal("grouped int8", as_numpy(got[0]), list(range(size)))
    expect_equal("grouped bool", as_numpy(got[1]), [r == 0 for r in range(size)])
    return "ok"


def split_rows(rows, size):
    base, extra = divmod(rows, size)
    counts = [base + (1 if r < extra else 0) for r in range(size)]
    return [sum(counts[:r]) for r in range(size)], counts


def check_reducescatter(rank, size):
    details = []
    for dtype in DTYPES:
        for rows in (2 * size + 1, size - 1):
            def inputs(r):
                if not rows:
                    return np.zeros([0, 5], np.int64)
                return wrap(np.stack([sum_values(r, dtype) + i for i in range(rows)]), dtype)
            every = np.stack([inputs(r) for r in range(size)])
            starts, counts = split_rows(rows, size)
            mine = slice(starts[rank], starts[rank] + counts[rank])
            x = tf.constant(inputs(rank), dtype)
            got = bps_tf.reducescatter(x, op=api.Sum, name=f"parity/rs/{dtype.name}/{rows}")
            assert got.dtype == dtype
            expect_equal(f"reducescatter {dtype.name} rows {rows}", as_numpy(got),
                         wrap(every.sum(0), dtype)[mine])
            details.append(f"{dtype.name}:{rows}->{counts[rank]}")
    x = tf.constant(np.arange(size * 2 + 1, dtype=np.float32) + rank)
    got = bps_tf.reducescatter(x, name="parity/rs/average", prescale_factor=2.0,
                               postscale_factor=0.5)
    starts, counts = split_rows(size * 2 + 1, size)
    want = (np.arange(size * 2 + 1) * size + size * (size - 1) / 2) / size
    expect_equal("reducescatter average", as_numpy(got),
                 want[starts[rank]:starts[rank] + counts[rank]])
    outs = bps_tf.grouped_reducescatter([tf.ones([size, 2], tf.int16),
                                         tf.ones([1], tf.float32)], op=api.Sum,
                                        name="parity/rs/grouped")
    expect_equal("grouped reducescatter", as_numpy(outs[0]), np.full([1, 2], size))
    expect_equal("grouped reducescatter uneven", as_numpy(outs[1]),
                 [float(size)] if rank == 0 else np.zeros([0]))
    return " ".join(details)


def a2a_values(source, dest, count, dtype):
    values = 16 * source + 4 * dest + np.arange(count, dtype=np.int64)
    return values % 2 == 0 if dtype == tf.bool else values


def check_alltoall(rank, size):
    plans = {
        "uneven": lambda s, d: (s + 2 * d) % 3,         # zeros included
        "one_sided": lambda s, d: (d + 1) if s == 0 else 0,
        "empty": lambda s, d: 0,
    }
    for label, plan in plans.items():
        for dtype in DTYPES + [tf.bool]:
            splits = [plan(rank, d) for d in range(size)]
            rows = [a2a_values(rank, d, splits[d], dtype) for d in range(size)]
            sent = np.stack([np.concatenate(rows)] * 3, axis=1)   # 3 columns
            got, got_splits = bps_tf.alltoall(tf.constant(sent, dtype), splits=splits,
                                              name=f"parity/a2a/{label}/{dtype.name}")
            want_splits = [plan(s, rank) for s in range(size)]
            want = np.concatenate([a2a_values(s, rank, want_splits[s], dtype)
                                   for s in range(size)])
            assert got.dtype == dtype and got_splits.dtype == tf.int32
            expect_equal(f"alltoall {label} {dtype.name} splits", got_splits.numpy(),
                         want_splits)
            expect_equal(f"alltoall {label} {dtype.name}", as_numpy(got),
                         np.stack([want] * 3, axis=1).reshape(-1, 3))

    @tf.function
    def in_graph(x):
        return bps_tf.alltoall(x, name="parity/a2a/even")

    # Without splits Horovod returns the received tensor alone.
    got = in_graph(tf.fill([2 * size], rank))
    expect_equal("alltoall even in tf.function", got.numpy(), np.repeat(np.arange(size), 2))
    check_byteps_alltoall(rank, size)
    return "ok"


def check_byteps_alltoall(rank, size):
    """BytePS's form: recv_splits checked, the tensor alone unless with_size."""
    plan = [[(s + d) % 3 + 1 for d in range(size)] for s in range(size)]   # plan[s][d] rows
    splits, expected = plan[rank], [plan[s][rank] for s in range(size)]
    sent = tf.fill([sum(splits), 2], float(rank + 1))
    want = np.concatenate([np.full([plan[s][rank], 2], s + 1.0) for s in range(size)])
    got = bps_tf.alltoall(sent, splits=splits, recv_splits=expected, name="parity/a2a/bps")
    expect_equal("byteps alltoall", got.numpy(), want)
    got, sizes = bps_tf.alltoall(sent, splits=splits, with_size=True, name="parity/a2a/bps")
    expect_equal("byteps alltoall with_size", got.numpy(), want)
    expect_equal("byteps alltoall sizes", sizes.numpy(), expected)
    # BytePS's device variants: the same rows; the result's device is the only difference.
    got = bps_tf.alltoall_cpu2gpu(sent, splits, recv_splits=expected, name="parity/a2a/c2g")
    expect_equal("byteps alltoall_cpu2gpu", got.numpy(), want)
    got, sizes = bps_tf.alltoall_gpu2cpu(sent, splits, with_size=True, name="parity/a2a/g2c")
    expect_equal("byteps alltoall_gpu2cpu", got.numpy(), want)
    expect_equal("byteps alltoall_gpu2cpu sizes", sizes.numpy(), expected)
    if "CPU" not in got.device:
        raise AssertionError(f"alltoall_gpu2cpu left its result on {got.device}")
    for label, recv in (("negative", [-100] + expected[1:]),
                        ("not what was sent", [expected[0] + 1] + expected[1:])):
        try:
            bps_tf.alltoall(sent, splits=splits, recv_splits=recv, name="parity/a2a/bad")
        except tf.errors.InvalidArgumentError as exc:
            if "recv_splits" not in str(exc):
                raise
        else:
            raise AssertionError(f"alltoall accepted {label} recv_splits {recv}")

    @tf.function
    def in_graph(x, recv):
        return bps_tf.alltoall(x, splits=splits, recv_splits=recv, name="parity/a2a/bps_graph")

    expect_equal("byteps alltoall in tf.function", in_graph(sent, tf.constant(expected)).numpy(),
                 want)
    try:
        in_graph(sent, tf.constant([expected[0] + 1] + expected[1:]))
    except tf.errors.InvalidArgumentError as exc:
        if "recv_splits" not in str(exc):
            raise
    else:
        raise AssertionError("alltoall in a tf.function accepted wrong recv_splits")


def check_barrier(rank, size):
    time.sleep(0.3 * rank)
    arrived = time.time()
    bps_tf.barrier()
    left = time.time()
    every = api.allgather(tf.constant([arrived], tf.float64), name="parity/barrier/arrivals")
    last = float(np.max(every.numpy()))
    if left < last:
        raise AssertionError(f"left the barrier at {left:.3f} before the last arrival {last:.3f}")

    @tf.function
    def in_graph():
        return bps_tf.barrier(name="parity/barrier/graph")

    expect_equal("barrier in tf.function", int(in_graph()), size)
    ops = [int(bps_tf.size_op()), int(bps_tf.rank_op())]
    expect_equal("size_op rank_op", ops, [size, rank])
    return f"waited {left - arrived:.2f} s"


def check_broadcast_in_place(rank, size):
    weights = tf.Variable(np.full([3], rank, np.float32), name="w")
    small = tf.Variable(np.full([2], rank - 100, np.int8), name="small")
    flags = tf.Variable([rank == 1, rank != 1], name="flags")
    out = bps_tf.broadcast_([weights, small, flags], root_rank=1, name="parity")
    assert out[0] is weights
    expect_equal("broadcast_ float", weights.numpy(), np.full([3], 1, np.float32))
    expect_equal("broadcast_ int8", small.numpy(), np.full([2], -99, np.int8))
    expect_equal("broadcast_ bool", flags.numpy(), [True, False])
    return "ok"


def check_sync_batch_norm(rank, size):
    per_rank = 5
    data = np.random.RandomState(3).randn(size * per_rank, 4).astype("float32") * 2 + 1
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    sync = bps_tf.SyncBatchNormalization(momentum=0.6, name="parity_sbn")
    plain = keras.layers.BatchNormalization(momentum=0.6)
    sync.build((None, 4))
    plain.build((None, 4))
    gamma = np.linspace(0.5, 2.0, 4).astype("float32")
    for layer in (sync, plain):
        layer.gamma.assign(gamma)
    weight = tf.constant(np.random.RandomState(4).randn(size * per_rank, 4).astype("float32"))

    @tf.function
    def sync_step(x, w):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = sync(x, training=True)
            loss = tf.reduce_sum(out * w)
        return out, tape.gradient(loss, x)

    with tf.GradientTape() as tape:
        whole = tf.constant(data)
        tape.watch(whole)
        want = plain(whole, training=True)
        want_loss = tf.reduce_sum(want * weight)
    want_grad = tape.gradient(want_loss, whole).numpy()
    got, grad = sync_step(tf.constant(data[mine]), weight[mine])
    worst = float(np.max(np.abs(got.numpy() - want.numpy()[mine])))
    worst_grad = float(np.max(np.abs(grad.numpy() - want_grad[mine])))
    worst_moving = max(float(np.max(np.abs(sync.moving_mean.numpy() - plain.moving_mean.numpy()))),
                       float(np.max(np.abs(sync.moving_variance.numpy()
                                           - plain.moving_variance.numpy()))))
    inference = float(np.max(np.abs(sync(data[mine], training=False).numpy()
                                    - plain(data[mine], training=False).numpy())))
    worst_all = max(worst, worst_grad, worst_moving, inference)
    if worst_all > 1e-5:
        raise AssertionError(f"SyncBatchNormalization differs from BatchNormalization on the "
                             f"whole batch: output {worst}, input gradient {worst_grad}, "
                             f"moving statistics {worst_moving}, inference {inference}")
    return f"max difference {worst_all:.2e}"


def check_allgather_object(rank, size):
    mine = {"rank": rank, "payload": "x" * (10 + 1000 * rank)}   # lengths differ per rank
    got = bps_tf.allgather_object(mine, name="parity_objects")
    want = [{"rank": r, "payload": "x" * (10 + 1000 * r)} for r in range(size)]
    if got != want:
        raise AssertionError(f"allgather_object gave {[g['rank'] for g in got]}")
    return "ok"


def check_gradient_predivide_factor(rank, size):
    """Dividing by the factor before the sum and by size/factor after it
    gives the plain average (exactly, for a power-of-two factor); other ops
    are refused."""
    w = tf.Variable(np.arange(4, dtype=np.float32) + 1.0, name="predivide_w")
    x = tf.constant(np.arange(4, dtype=np.float32) * (rank + 1))

    def grad(**kw):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w * x)
        return bps_tf.DistributedGradientTape(tape, **kw).gradient(loss, [w])[0].numpy()

    plain = grad()
    split = grad(gradient_predivide_factor=4.0)
    want = np.mean([2 * w.numpy() * np.arange(4) * (r + 1) for r in range(size)], axis=0)
    np.testing.assert_allclose(plain, want, rtol=1e-6)
    expect_equal("predivide 4 vs plain average", split, plain)
    try:
        bps_tf.DistributedGradientTape(tf.GradientTape(), op=bps_tf.Sum,
                                       gradient_predivide_factor=2.0)
    except ValueError as exc:
        assert "op=Average" in str(exc), exc
    else:
        raise AssertionError("gradient_predivide_factor with op=Sum was accepted")
    return "ok"


def check_server_reductions(rank, size):
    """Min/Max/Product computed by the servers: every dtype inside one
    tf.function (exact vs numpy, including nan and the 16-bit types'
    products), their gradients against TensorFlow's own reduce_min/max/prod
    over the stack of every rank's input, and a reduce op that differs
    between ranks for one name is an error on every rank, not a mixed result."""
    ops = ((api.Min, np.min), (api.Max, np.max), (api.Product, np.prod))

    @tf.function
    def every_dtype(xs):
        return [[api.allreduce(x, op=op, name=f"server_reduce/{op.name}/{x.dtype.name}")
                 for op, _ in ops] for x in xs]

    xs = [tf.constant(small_values(rank, d), d) for d in DTYPES]
    for dtype, outs in zip(DTYPES, every_dtype(xs)):
        small = np.stack([small_values(r, dtype) for r in range(size)])
        for (op, fn), got in zip(ops, outs):
            assert got.dtype == dtype
            expect_equal(f"function {op.name} {dtype.name}", as_numpy(got),
                         wrap(fn(small, 0), dtype))
    # nan wins a min and a max, as in numpy
    got = api.allreduce(tf.constant([np.nan if rank == 1 else 1.0, float(rank)]), op=api.Min,
                        name="server_reduce/nan")
    want = np.min([[np.nan if r == 1 else 1.0, float(r)] for r in range(size)], 0)
    if not np.array_equal(got.numpy(), want, equal_nan=True):
        raise AssertionError(f"min with nan: {got.numpy()} != {want}")
    # ties share a min's gradient, a product's is the product of the others
    every = np.asarray([[1.0, 2.0 + r, 3.0, -1.0 - r] for r in range(size)])
    x = tf.constant(every[rank])
    for op, reduce in ((api.Min, tf.reduce_min), (api.Max, tf.reduce_max),
                       (api.Product, tf.reduce_prod)):
        upstream = tf.constant([1.0, 2.0, 3.0, 4.0], tf.float64) * (rank + 1)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = api.allreduce(x, op=op, name=f"server_reduce/grad/{op.name}")
            loss = tf.reduce_sum(y * upstream)
        got = tape.gradient(loss, x).numpy()
        stacked = tf.constant(every)
        with tf.GradientTape() as tape:
            tape.watch(stacked)
            ref = reduce(stacked, axis=0)
            total = sum(tf.reduce_sum(ref * tf.constant([1.0, 2.0, 3.0, 4.0], tf.float64) * (r + 1))
                        for r in range(size))
        want = tape.gradient(total, stacked).numpy()[rank]
        if not np.allclose(got, want, rtol=1e-12, atol=0):
            raise AssertionError(f"gradient of {op.name}: {got} != {want}")
    try:
        api.allreduce(tf.constant([1.0]), op=api.Min if rank == 0 else api.Max,
                      name="server_reduce/mismatch")
    except tf.errors.FailedPreconditionError as exc:
        message = str(exc)
        if "server_reduce/mismatch" not in message or "min" not in message \
                or "max" not in message:
            raise AssertionError(f"mismatch error does not name the op and both values: "
                                 f"{message}")
        return "ok"
    raise AssertionError("Min on one rank and Max on another under one name did not fail")


def check_horovod_peer_semantics(rank, size):
    """Across workers, as Horovod's own tests expect: a local source's
    gradient is kept (divided by size), the others averaged; elastic state
    syncs rank 0's variables and attributes; an integer prescale by a
    fraction truncates on every worker before the sum."""
    a, b = tf.Variable([float(rank + 1)]), tf.Variable([float(rank + 1)])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(a * a + b * b)
    tape = bps_tf.DistributedGradientTape(tape)
    tape.register_local_source(b)
    ga, gb = tape.gradient(loss, [a, b])
    expect_equal("reduced gradient", ga, [float(size + 1)])
    expect_equal("local gradient", gb, np.float32([2.0 * (rank + 1)]) / np.float32(size))
    v = tf.Variable([float(rank)])
    state = bps_tf.elastic.TensorFlowState([v], epoch=rank)
    state.sync()
    expect_equal("elastic sync", v, [0.0])
    assert state.epoch == 0, state.epoch
    got = api.allreduce(tf.constant([7], tf.int32), op=api.Sum, prescale_factor=0.5,
                        name="peer/int_prescale")
    expect_equal("integer prescale", got, [3 * size])
    init = keras.initializers.Constant(float(rank))
    model = keras.Sequential([keras.layers.Dense(1, kernel_initializer=init,
                                                 bias_initializer=init)])
    model.build((None, 1))
    callback = bps_tf.keras.callbacks.BroadcastGlobalVariablesCallback(
        0, local_variables=[model.layers[0].bias])
    callback.set_model(model)
    callback.on_train_begin()
    kernel, bias = model.get_weights()
    expect_equal("broadcast kernel, local bias", [kernel[0, 0], bias[0]], [0.0, float(rank)])
    return "ok"


def run_all(checks, rank, size):
    """Runs every parity check through ``checks.run`` (tf_checks.Checks)."""
    checks.run("parity_allreduce", lambda: check_allreduce_every_dtype_and_op(rank, size))
    checks.run("parity_server_reductions", lambda: check_server_reductions(rank, size))
    checks.run("parity_allgather_broadcast",
               lambda: check_allgather_and_broadcast_every_dtype(rank, size))
    checks.run("parity_reducescatter", lambda: check_reducescatter(rank, size))
    checks.run("parity_alltoall", lambda: check_alltoall(rank, size))
    checks.run("parity_barrier", lambda: check_barrier(rank, size))
    checks.run("parity_broadcast_in_place", lambda: check_broadcast_in_place(rank, size))
    checks.run("parity_sync_batch_norm", lambda: check_sync_batch_norm(rank, size))
    checks.run("parity_allgather_object", lambda: check_allgather_object(rank, size))
    checks.run("parity_gradient_predivide_factor",
               lambda: check_gradient_predivide_factor(rank, size))
    checks.run("parity_horovod_peer_semantics", lambda: check_horovod_peer_semantics(rank, size))
    checks.run("parity_gradients_eager", lambda: gradient_checks.run("eager", rank, size))
    checks.run("parity_gradients_function", lambda: gradient_checks.run("function", rank, size))
