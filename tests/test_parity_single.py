"""Horovod parity in one process (size 1): every dtype through every
collective, Min/Max/Product, reducescatter, alltoall, grouped_allgather,
barrier, broadcast_, the *_op queries, the build queries and
SyncBatchNormalization. Cross-worker results are checked in
tests/workers/parity_checks.py (run by test_tf_multiworker.py)."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import bps_tf  # noqa: E402
import bps_tf.runtime.basics as basics  # noqa: E402
import bps_tf.ops as bps_ops  # noqa: E402
import bps_tf.keras as bps_keras  # noqa: E402
from bps_tf.horovod import api, scatter_gather  # noqa: E402

REDUCE_DTYPES = [tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64,
                 tf.float16, tf.bfloat16, tf.float32, tf.float64]
OPS = [api.Sum, api.Average, api.Min, api.Max, api.Product]


@pytest.fixture(scope="module", autouse=True)
def initialized():
    bps_tf.init()
    assert basics.size() == 1
    yield
    basics.shutdown()


@pytest.fixture
def op_names(monkeypatch):
    """The tensor_name of every push_pull/broadcast op call, in order."""
    names = []
    real_pp, real_bc = bps_ops.push_pull_sum, bps_ops.broadcast_raw
    real_reduce = bps_ops.push_pull_reduce

    def push_pull_sum(tensor, tensor_name, priority=0, **kwargs):
        names.append(tensor_name)
        return real_pp(tensor, tensor_name=tensor_name, priority=priority, **kwargs)

    def push_pull_reduce(tensor, tensor_name, reduce_op, priority=0, **kwargs):
        names.append(f"{tensor_name} ({reduce_op})")
        return real_reduce(tensor, tensor_name=tensor_name, reduce_op=reduce_op,
                           priority=priority, **kwargs)

    def broadcast_raw(tensor, tensor_name, root_rank, priority=0, **kwargs):
        names.append(tensor_name)
        return real_bc(tensor, tensor_name=tensor_name, root_rank=root_rank, priority=priority,
                       **kwargs)

    monkeypatch.setattr(bps_ops, "push_pull_sum", push_pull_sum)
    monkeypatch.setattr(bps_ops, "push_pull_reduce", push_pull_reduce)
    monkeypatch.setattr(bps_ops, "broadcast_raw", broadcast_raw)
    return names


def _values(dtype):
    return tf.constant([[1, 5, 0], [3, 2, 7]], dtype)


@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=lambda d: d.name)
def test_every_dtype_through_every_collective(dtype):
    x = _values(dtype)
    for op in OPS:
        out = api.allreduce(x, op=op, name=f"single/{dtype.name}/{op.name}")
        assert out.dtype == dtype, op
        np.testing.assert_array_equal(out.numpy(), x.numpy())
    for out in (api.allgather(x, name=f"single/gather/{dtype.name}"),
                api.broadcast(x, 0, name=f"single/bcast/{dtype.name}"),
                bps_tf.reducescatter(x, op=api.Sum, name=f"single/rs/{dtype.name}"),
                bps_tf.alltoall(x, name=f"single/a2a/{dtype.name}")):
        assert out.dtype == dtype
        np.testing.assert_array_equal(out.numpy(), x.numpy())


def test_bool_broadcast_allgather_alltoall_but_not_allreduce():
    x = tf.constant([[True, False], [False, True]])
    for out in (api.broadcast(x, 0), api.allgather(x), bps_tf.alltoall(x)):
        assert out.dtype == tf.bool
        np.testing.assert_array_equal(out.numpy(), x.numpy())
    for bad in (lambda: api.allreduce(x), lambda: bps_tf.reducescatter(x)):
        with pytest.raises(TypeError, match="bool"):
            bad()


def test_narrow_integer_average_is_the_floor_of_the_exact_mean(monkeypatch):
    # At size 1 the sum is a copy; pretend 2 workers: 250 / 2 in uint8 is
    # 125 (the mean of the int32 sum), -127 / 2 in int8 is -64 (floor).
    monkeypatch.setattr(basics, "size", lambda: 2)
    out = api.allreduce(tf.constant([250, 7], tf.uint8), op=api.Average, name="narrow/u8")
    np.testing.assert_array_equal(out.numpy(), [125, 3])
    out = api.allreduce(tf.constant([-127, 9], tf.int8), op=api.Average, name="narrow/i8")
    np.testing.assert_array_equal(out.numpy(), [-64, 4])


def test_min_max_product_keys_scaling_and_graph_mode(op_names):
    x = tf.constant([2.0, -3.0])
    out = api.allreduce(x, op=api.Product, name="p", prescale_factor=2.0, postscale_factor=0.5)
    np.testing.assert_array_equal(out.numpy(), [2.0, -3.0])
    # One op on the servers, no allgather.
    assert op_names == ["PushPull/p (product)"]

    @tf.function
    def in_graph(t):
        return api.allreduce(t, op=api.Min, name="m"), api.allreduce(tf.constant(4), op=api.Max)

    low, high = in_graph(x)
    np.testing.assert_array_equal(low.numpy(), [2.0, -3.0])
    assert int(high) == 4           # a scalar comes back a scalar
    assert "PushPull/m (min)" in op_names
    for graph_op in in_graph.get_concrete_function(x).graph.get_operations():
        if graph_op.type == "BytepsPushPull" and graph_op.get_attr("reduce_op") != b"sum":
            assert "CPU" in graph_op.device.upper(), graph_op.device
    with pytest.raises(NotImplementedError, match="ADASUM"):
        api.allreduce(x, op=api.Adasum)
    with pytest.raises(NotImplementedError, match="Sum or Average"):
        api.allreduce(tf.IndexedSlices(x, tf.constant([0, 1])), op=api.Min)
    for compression in (bps_tf.Compression.fp16, bps_tf.Compression.topk(0.5)):
        with pytest.raises(ValueError, match="takes no compression"):
            api.allreduce(x, op=api.Max, compression=compression)


def test_min_max_product_refused_in_async_mode(monkeypatch):
    from bps_tf.comm import async_training
    monkeypatch.setattr(async_training, "enabled", lambda: True)
    with pytest.raises(NotImplementedError, match="asynchronous"):
        api.allreduce(tf.constant([1.0]), op=api.Min, name="async/min")


@pytest.mark.parametrize("rows,size,want", [
    (7, 3, [(0, 3), (3, 2), (5, 2)]),
    (6, 3, [(0, 2), (2, 2), (4, 2)]),
    (2, 3, [(0, 1), (1, 1), (2, 0)]),
    (0, 2, [(0, 0), (0, 0)]),
])
def test_reducescatter_split_gives_lower_ranks_the_extra_rows(rows, size, want):
    assert [scatter_gather.scatter_rows(rows, r, size) for r in range(size)] == want
    got = [tuple(int(v) for v in scatter_gather.scatter_rows(tf.constant(rows, tf.int64), r, size))
           for r in range(size)]
    assert got == want


def test_reducescatter_average_scaling_and_errors(op_names):
    x = tf.constant([[2.0, 4.0], [6.0, 8.0], [1.0, 3.0]])
    out = bps_tf.reducescatter(x, name="rs", prescale_factor=2.0, postscale_factor=0.25)
    np.testing.assert_array_equal(out.numpy(), x.numpy() * 0.5)
    assert op_names == ["Reducescatter/rs"]
    with pytest.raises(NotImplementedError, match="Sum or Average"):
        bps_tf.reducescatter(x, op=api.Max)
    with pytest.raises(ValueError, match="at least one dimension"):
        bps_tf.reducescatter(tf.constant(1.0))
    outs = bps_tf.grouped_reducescatter([x, tf.ones([1], tf.int16)], op=api.Sum, name="g")
    assert outs[1].dtype == tf.int16 and op_names[-2:] == ["Reducescatter/g/0", "Reducescatter/g/1"]


def test_alltoall_splits_empty_and_errors(op_names):
    x = tf.reshape(tf.range(6, dtype=tf.int32), [3, 2])
    got, splits = bps_tf.alltoall(x, splits=[3], name="a")
    np.testing.assert_array_equal(got.numpy(), x.numpy())
    assert splits.dtype == tf.int32 and splits.numpy().tolist() == [3]
    assert op_names == ["Alltoall/a/splits/counts", "Alltoall/a/splits/data",
                        "Alltoall/a/data/counts", "Alltoall/a/data/data"]
    got, splits = bps_tf.alltoall(tf.zeros([0, 4], tf.uint8), splits=tf.constant([0]))
    assert got.shape == (0, 4) and got.dtype == tf.uint8 and splits.numpy().tolist() == [0]
    with pytest.raises(tf.errors.InvalidArgumentError, match="add up"):
        bps_tf.alltoall(x, splits=[2])
    with pytest.raises(tf.errors.InvalidArgumentError, match="vector of size"):
        bps_tf.alltoall(x, splits=[1, 2])

    @tf.function
    def in_graph(t, s):
        return bps_tf.alltoall(t, splits=s)

    got, splits = in_graph(x, tf.constant([3]))
    np.testing.assert_array_equal(got.numpy(), x.numpy())
    with pytest.raises(tf.errors.InvalidArgumentError, match="add up"):
        in_graph(x, tf.constant([1]))
    # BytePS's keywords: recv_splits/with_size choose its return form.
    assert isinstance(bps_tf.alltoall(x, splits=[3], recv_splits=[3]), tf.Tensor)
    with pytest.raises(NotImplementedError, match="call alltoall once per tensor"):
        bps_tf.alltoall([x, x], splits=[3], recv_splits=[3])
    with pytest.raises(ValueError, match="compression is not supported"):
        bps_tf.alltoall(x, splits=[3], compression=api.Compression.fp16)
    # BytePS's device variants move the same rows; without a GPU both land on the CPU.
    for variant in (bps_tf.alltoall_cpu2gpu, bps_tf.alltoall_gpu2cpu):
        got, sizes = variant(x, [3], recv_splits=[3], with_size=True)
        np.testing.assert_array_equal(got.numpy(), x.numpy())
        assert sizes.numpy().tolist() == [3]
        with pytest.raises(NotImplementedError, match="call alltoall once per tensor"):
            variant([x, x], [3], recv_splits=[3])
    assert "CPU" in bps_tf.alltoall_gpu2cpu(x, [3]).device


def test_grouped_allgather_names_each_tensor(op_names):
    outs = bps_tf.grouped_allgather([tf.ones([2, 1]), tf.constant([True])], name="gg")
    assert [o.dtype for o in outs] == [tf.float32, tf.bool]
    assert op_names == ["Allgather/gg/0/counts", "Allgather/gg/0/data",
                        "Allgather/gg/1/counts", "Allgather/gg/1/data"]


def test_barrier_and_rank_queries(op_names):
    assert bps_tf.barrier() is None
    assert op_names[0].startswith("Barrier/eager.")

    @tf.function
    def in_graph():
        return bps_tf.barrier(), bps_tf.size_op(), bps_tf.rank_op()

    arrived, size, rank = in_graph()
    assert (int(arrived), int(size), int(rank)) == (1, 1, 0)
    for query, want in ((bps_tf.size_op, 1), (bps_tf.rank_op, 0),
                        (bps_tf.local_size_op, 1), (bps_tf.local_rank_op, 0)):
        t = query()
        assert t.dtype == tf.int32 and t.shape == () and int(t) == want
    with pytest.raises(ValueError, match="no process set has process_set_id=7"):
        bps_tf.size_op(process_set_id=7)


def test_broadcast_in_place_returns_the_variables(op_names):
    v = tf.Variable([1.0, 2.0], name="w")
    flags = tf.Variable([True, False], name="w")
    assert bps_tf.broadcast_(v, root_rank=0) is v
    out = bps_tf.broadcast_([v, flags], 0, name="pair")
    assert out[0] is v and out[1] is flags
    assert op_names == ["Broadcast_/w", "Broadcast_/pair/w", "Broadcast_/pair/w_1"]
    with pytest.raises(ValueError, match="root_rank 1"):
        bps_tf.broadcast_(v, root_rank=1)


def test_byteps_string_ops_and_unknown_ops():
    """BytePS names its ops with strings ("Average", "Sum")."""
    x = tf.constant([2.0, 4.0])
    assert api.resolve_op(None, "Sum") is api.Sum and api.resolve_op(None, "average") is api.Average
    np.testing.assert_array_equal(bps_tf.push_pull(x, op="Sum"), [2.0, 4.0])
    with pytest.raises(NotImplementedError, match="ADASUM"):
        bps_tf.push_pull(x, op="Adasum")
    for bad in ("Median", 17):
        with pytest.raises(ValueError, match="unknown reduce op"):
            api.resolve_op(None, bad)


def test_build_queries_are_honest():
    from tensorflow.python.framework import kernels
    gpu = any(k.device_type == "GPU"
              for k in kernels.get_registered_kernels_for_op("BytepsPushPull").kernel)
    assert bps_tf.cuda_built() is gpu
    for query in (bps_tf.mpi_built, bps_tf.gloo_built, bps_tf.nccl_built, bps_tf.ddl_built,
                  bps_tf.ccl_built, bps_tf.rocm_built, bps_tf.sycl_built, bps_tf.mpi_enabled,
                  bps_tf.gloo_enabled, bps_tf.mpi_threads_supported):
        assert query() is False


def test_sync_batch_norm_matches_batch_norm_at_size_one(op_names):
    assert bps_keras.SyncBatchNormalization is bps_tf.SyncBatchNormalization
    x = tf.random.stateless_normal([16, 3], seed=[1, 2]) * 3.0 + 1.0
    sync, plain = bps_tf.SyncBatchNormalization(momentum=0.5), keras.layers.BatchNormalization(momentum=0.5)
    for training in (True, False):
        np.testing.assert_allclose(sync(x, training=training).numpy(),
                                   plain(x, training=training).numpy(), atol=1e-5)
    np.testing.assert_allclose(sync.moving_mean.numpy(), plain.moving_mean.numpy(), atol=1e-5)
    np.testing.assert_allclose(sync.moving_variance.numpy(), plain.moving_variance.numpy(),
                               atol=1e-5)
    assert op_names and op_names[0].startswith("SyncBatchNormalization/")
    config = sync.get_config()
    assert type(bps_tf.SyncBatchNormalization.from_config(config)) is bps_tf.SyncBatchNormalization


def test_sync_batch_norm_trains_in_fit():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              bps_tf.SyncBatchNormalization(), keras.layers.Dense(1)])
    model.compile(optimizer=bps_keras.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                  loss="mse", jit_compile=False)
    x = np.random.RandomState(0).randn(32, 4).astype("float32")
    history = model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_the_global_process_set_and_refused_process_sets():
    gps = bps_tf.global_process_set
    assert gps.size() == 1 and gps.rank() == 0 and gps.included()
    x = tf.constant([1.0, 2.0])
    np.testing.assert_array_equal(api.allreduce(x, op=api.Sum, process_set=gps).numpy(), [1, 2])
    np.testing.assert_array_equal(api.allgather(x, process_set=gps).numpy(), [1, 2])
    np.testing.assert_array_equal(api.broadcast(x, 0, process_set=gps).numpy(), [1, 2])
    np.testing.assert_array_equal(
        scatter_gather.reducescatter(x, op=api.Sum, process_set=gps).numpy(), [1, 2])
    # Every rank is the global set, registered already (Horovod refuses it too).
    with pytest.raises(ValueError, match="exists already"):
        bps_tf.add_process_set([0])
    with pytest.raises(ValueError, match=r"ranks must be in \[0, 1\)"):
        bps_tf.add_process_set([0, 1])
    subset = bps_tf.ProcessSet([0, 1])
    assert subset.size() is None and subset.process_set_id is None
    for call in (lambda: api.allreduce(x, process_set=subset),
                 lambda: scatter_gather.alltoall(x, process_set=subset),
                 lambda: api.broadcast(x, 0, process_set=subset)):
        with pytest.raises(ValueError, match="is not registered"):
            call()
    assert bps_tf.remove_process_set(gps) is False


def test_join_alone_returns_rank_0_eagerly_in_a_function_and_in_a_session():
    assert bps_tf.join() == 0
    assert bps_tf.join(device="/cpu:0") == 0     # again (next epoch), Horovod's argument
    out = api.allreduce(tf.constant([3.0]), op=api.Sum, name="single/after_join")
    np.testing.assert_array_equal(out.numpy(), [3.0])
    in_function = tf.function(lambda: bps_tf.join())()
    assert in_function.dtype == tf.int32 and in_function.numpy() == 0
    with tf.Graph().as_default():
        joined = bps_tf.join()
        with tf.compat.v1.Session() as session:
            assert session.run(joined) == 0


def test_horovod_peer_semantics_at_size_one():
    """What Horovod's own tests expect of the API: ``alltoall`` without splits
    returns the tensor alone; bad splits are InvalidArgumentError; an
    IndexedSlices allreduce takes no pre/postscaling (NotImplementedError);
    integer tensors scale in float64 and truncate, float16 in float32;
    ``util._executing_eagerly``, ``elastic`` state and
    ``PartialDistributedGradientTape`` exist."""
    x = tf.constant([[1, 2], [3, 4]], tf.int32)
    assert isinstance(bps_tf.alltoall(x), tf.Tensor)
    with pytest.raises(tf.errors.InvalidArgumentError):
        bps_tf.alltoall(x, splits=[3])
    slices = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([0]))
    for scaling in ({"prescale_factor": 0.5}, {"postscale_factor": 0.5}):
        with pytest.raises(NotImplementedError):
            bps_tf.allreduce(slices, op=bps_tf.Sum, **scaling)
    got = bps_tf.allreduce(tf.constant([7, -7], tf.int32), op=bps_tf.Sum, prescale_factor=0.5)
    assert got.numpy().tolist() == [3, -3]          # trunc(3.5), trunc(-3.5)
    half = bps_tf.allreduce(tf.constant([0.1], tf.float16), op=bps_tf.Sum, postscale_factor=0.3)
    want = tf.cast(tf.cast(tf.constant([0.1], tf.float16), tf.float32) * 0.3, tf.float16)
    assert half.numpy().tolist() == want.numpy().tolist()
    assert bps_tf.util._executing_eagerly() and bps_tf._executing_eagerly()
    v = tf.Variable([1.0, 2.0])
    state = bps_tf.elastic.TensorFlowState([v], batch=3)
    state.sync()
    v.assign([5.0, 6.0])
    state.batch = 4
    state.restore()
    assert v.numpy().tolist() == [1.0, 2.0] and state.batch == 3
    v.assign([5.0, 6.0])
    state.commit()
    state.restore()
    assert v.numpy().tolist() == [5.0, 6.0]
    assert bps_keras.elastic.KerasState is bps_tf.elastic.KerasState
    layer = keras.layers.Dense(1, kernel_initializer="ones")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(tf.ones([1, 2])))
    tape = bps_tf.PartialDistributedGradientTape(tape, local_layers=[layer])
    local, shared = tape.get_local_and_global_gradients(loss, layer.trainable_weights)
    assert len(local) == 2 and not shared


@pytest.mark.parametrize("passes", [1, 2])
def test_partial_distributed_optimizer_keeps_local_layers_local(op_names, passes):
    """Keras 3: PartialDistributedOptimizer (Horovod's) reduces only the
    shared layers' gradients. A local one is this worker's own; with
    backward_passes_per_step=2 its two passes are summed (Horovod's default),
    as the shared ones are, although Keras 3 accumulates their mean."""
    local = keras.layers.Dense(1, kernel_initializer="zeros", use_bias=False, name="own")
    shared = keras.layers.Dense(1, kernel_initializer="zeros", use_bias=False, name="common")
    local.build((None, 1))
    shared.build((None, 1))
    opt = bps_keras.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=local,
                                                backward_passes_per_step=passes)
    variables = [local.kernel, shared.kernel]
    for step in range(passes):
        grads = [tf.constant([[float(step + 1)]]), tf.constant([[10.0 * (step + 1)]])]
        opt.apply(grads, variables)
    assert op_names and all("common" in n and "own" not in n for n in op_names), op_names
    total = sum(range(1, passes + 1))
    assert local.kernel.numpy().tolist() == [[-float(total)]]
    assert shared.kernel.numpy().tolist() == [[-10.0 * total]]


def test_compile_takes_horovods_experimental_run_tf_function():
    """Horovod's Keras examples pass experimental_run_tf_function=False;
    Keras 3 alone refuses it. Other unknown arguments are still refused."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=bps_keras.DistributedOptimizer(keras.optimizers.SGD()),
                  experimental_run_tf_function=False)
    assert model.compiled
    with pytest.raises(TypeError, match="no_such_argument"):
        model.compile(loss="mse", no_such_argument=1)


def test_partial_distributed_optimizer_refuses_a_tf1_optimizer():
    layer = keras.layers.Dense(1)
    layer.build((None, 2))
    with pytest.raises(NotImplementedError, match="tf.compat.v1 optimizer"):
        bps_keras.PartialDistributedOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(0.1), local_layers=[layer])
