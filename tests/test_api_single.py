"""bps_tf.horovod.api and bps_tf.keras in one process (size 1, no cluster).

At size 1 the op is a copy, so tests that need a real reduction pretend to a
larger job by patching ``basics.size`` (the op still copies): that checks the
averaging arithmetic of this layer. Cross-worker sums are checked in
test_tf_multiworker.py.
"""
import os
import subprocess
import tempfile
import sys
import time

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import bps_tf  # noqa: E402
import bps_tf.runtime.basics as basics  # noqa: E402
import bps_tf.ops as bps_ops  # noqa: E402
from bps_tf.horovod import api  # noqa: E402
from bps_tf.horovod.tape import DistributedGradientTape  # noqa: E402
import bps_tf.keras as bps_keras  # noqa: E402
from bps_tf.keras import callbacks as bps_callbacks  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64]


@pytest.fixture(scope="module", autouse=True)
def initialized():
    bps_tf.init()
    assert basics.size() == 1
    yield
    basics.shutdown()


@pytest.fixture
def fake_size(monkeypatch):
    """Pretend the job has n workers (the op still copies: sum == input)."""
    def set_size(n):
        monkeypatch.setattr(basics, "size", lambda: n)
    return set_size


@pytest.fixture
def op_calls(monkeypatch):
    """Records (kind, tensor_name, priority) of every op call, then runs the real op."""
    calls = []
    real_pp, real_bc = bps_ops.push_pull_sum, bps_ops.broadcast_raw

    def push_pull_sum(tensor, tensor_name, priority=0, **kwargs):
        calls.append(("push_pull", tensor_name, priority))
        return real_pp(tensor, tensor_name=tensor_name, priority=priority, **kwargs)

    def broadcast_raw(tensor, tensor_name, root_rank, priority=0, **kwargs):
        calls.append(("broadcast", tensor_name, priority))
        return real_bc(tensor, tensor_name=tensor_name, root_rank=root_rank, priority=priority,
                       **kwargs)

    monkeypatch.setattr(bps_ops, "push_pull_sum", push_pull_sum)
    monkeypatch.setattr(bps_ops, "broadcast_raw", broadcast_raw)
    return calls


# --------------------------------------------------------------------------
# push_pull
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("op", [api.Sum, api.Average], ids=["sum", "average"])
def test_push_pull_keeps_value_and_dtype(dtype, op):
    x = tf.constant([[1, -2, 3], [4, 5, -6]], dtype)
    out = api.push_pull(x, op=op, name=f"keep/{dtype.name}/{op.name}")
    assert out.dtype == dtype
    assert out.shape == x.shape
    np.testing.assert_array_equal(out.numpy(), x.numpy())


def test_push_pull_empty_and_scalar():
    assert api.push_pull(tf.zeros([0, 3]), name="empty").shape == (0, 3)
    assert float(api.push_pull(tf.constant(2.5), name="scalar")) == 2.5


def test_average_divides_by_size_and_sum_does_not(fake_size):
    fake_size(4)
    x = tf.constant([4.0, 8.0, -2.0])
    np.testing.assert_allclose(api.push_pull(x, op=api.Average).numpy(), [1.0, 2.0, -0.5])
    np.testing.assert_allclose(api.push_pull(x, op=api.Sum).numpy(), [4.0, 8.0, -2.0])
    # Default is Average; average= maps to op like Horovod.
    np.testing.assert_allclose(api.push_pull(x).numpy(), [1.0, 2.0, -0.5])
    np.testing.assert_allclose(api.push_pull(x, average=False).numpy(), [4.0, 8.0, -2.0])
    np.testing.assert_allclose(api.allreduce(x, average=True).numpy(), [1.0, 2.0, -0.5])


@pytest.mark.parametrize("dtype", [tf.int32, tf.int64], ids=lambda d: d.name)
def test_integer_average_floors_and_keeps_dtype(fake_size, dtype):
    fake_size(2)
    out = api.push_pull(tf.constant([3, -3, 4, 7], dtype), op=api.Average)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out.numpy(), [1, -2, 2, 3])


def test_prescale_and_postscale(fake_size):
    fake_size(2)
    x = tf.constant([1.0, 2.0])
    out = api.push_pull(x, op=api.Average, prescale_factor=3.0, postscale_factor=0.5)
    np.testing.assert_allclose(out.numpy(), [0.75, 1.5])
    out = api.push_pull(tf.constant([5], tf.int32), op=api.Sum, prescale_factor=2)
    assert out.numpy().tolist() == [10]
    out = api.push_pull(tf.constant([5], tf.int32), op=api.Sum, prescale_factor=0.5)
    assert out.numpy().tolist() == [2]   # float64 math truncated, as Horovod (op copies)


def test_op_and_average_together_is_an_error():
    with pytest.raises(ValueError, match="not both"):
        api.push_pull(tf.ones([2]), average=True, op=api.Sum)
    with pytest.raises(ValueError, match="not both"):
        api.allreduce(tf.ones([2]), average=False, op=api.Average)


def test_unsupported_reduce_ops_and_dtypes_fail_clearly():
    with pytest.raises(NotImplementedError, match="ADASUM"):
        api.push_pull(tf.ones([2]), op=api.Adasum)
    with pytest.raises(TypeError, match="uint32"):
        api.push_pull(tf.ones([2], tf.uint32))
    with pytest.raises(TypeError, match="bool"):
        api.push_pull(tf.constant([True]))


def test_fp16_compression_round_trip(op_calls):
    x = tf.constant([1.0, 1.0 / 3.0, 1000.5], tf.float32)
    out = api.push_pull(x, op=api.Sum, compression=api.Compression.fp16, name="fp16")
    assert out.dtype == tf.float32
    # The value went through float16: 1/3 comes back rounded to a half.
    np.testing.assert_array_equal(out.numpy(), x.numpy().astype(np.float16).astype(np.float32))
    assert out.numpy()[1] != np.float32(1.0 / 3.0)
    # Integer tensors are not compressed.
    ints = tf.constant([70000], tf.int32)
    compressed, ctx = api.Compression.fp16.compress(ints)
    assert compressed.dtype == tf.int32 and ctx is None
    assert api.push_pull(ints, op=api.Sum, compression=api.Compression.fp16).numpy()[0] == 70000
    # Out of float16's range: scaled on the way, never turned into inf.
    big = tf.constant([70000.0, -1e5, 1e-6, 0.0], tf.float32)
    out = api.push_pull(big, op=api.Sum, compression=api.Compression.fp16, name="fp16/big")
    assert np.all(np.isfinite(out.numpy())), out
    # Relative precision of float16 for the large values; 1e-6, scaled with
    # them (by 2^-2), lands among float16's subnormals (spacing 2^-24 there).
    np.testing.assert_allclose(out.numpy(), big.numpy(), rtol=2.0 ** -10, atol=2.0 ** -24 * 4)
    # An inf in the input stays inf; the other values are not hurt by it.
    out = api.push_pull(tf.constant([np.inf, 3.0]), op=api.Sum,
                        compression=api.Compression.fp16, name="fp16/inf")
    assert out.numpy()[0] == np.inf and out.numpy()[1] == 3.0
    f64, ctx = api.Compression.fp16.compress(tf.constant([0.5], tf.float64))
    assert f64.dtype == tf.float16
    assert api.Compression.fp16.decompress(f64, ctx).dtype == tf.float64


# --------------------------------------------------------------------------
# names
# --------------------------------------------------------------------------
def test_explicit_name_gets_family_prefix(op_calls):
    api.push_pull(tf.ones([2]), name="grad/w")
    api.broadcast(tf.ones([2]), root_rank=0, name="grad/w")
    assert op_calls == [("push_pull", "PushPull/grad/w", 0), ("broadcast", "Broadcast/grad/w", 0)]


def test_eager_names_count_calls_in_order(op_calls):
    api.push_pull(tf.ones([2]))
    api.push_pull(tf.ones([3]))
    first, second = (int(name.rsplit(".", 1)[1]) for _, name, _ in op_calls)
    assert [name.rsplit(".", 1)[0] for _, name, _ in op_calls] == ["PushPull/eager"] * 2
    assert second == first + 1


def test_graph_names_come_from_op_names_and_repeats_are_numbered(op_calls):
    @tf.function
    def step(x):
        doubled = tf.multiply(x, 2.0, name="doubled")
        return (api.push_pull(doubled), api.push_pull(doubled),
                api.push_pull(x, name="mine", priority=7))

    step(tf.ones([2]))
    assert op_calls == [("push_pull", "PushPull/doubled", 0),
                        ("push_pull", "PushPull/doubled_1", 0),
                        ("push_pull", "PushPull/mine", 7)]


def _run_alone(code):
    """Runs ``code`` in a fresh single-process interpreter (no cluster) from a
    neutral directory: ``-c`` puts the current one on sys.path, and the source
    tree must not shadow the installed package."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("DMLC_ROLE", None)
    return subprocess.run([sys.executable, "-c", code], cwd=tempfile.gettempdir(), env=env,
                          capture_output=True, text=True, timeout=120)


def test_calls_before_init_fail_clearly():
    code = ("import tensorflow as tf\n"
            "from bps_tf.horovod import api\n"
            "try:\n"
            "    api.push_pull(tf.ones([2]))\n"
            "except RuntimeError as e:\n"
            "    print('ERR', e)\n")
    out = _run_alone(code)
    assert "ERR" in out.stdout, out.stdout + out.stderr
    assert "bps_tf.init()" in out.stdout


# --------------------------------------------------------------------------
# allgather, broadcast
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_allgather_single_worker_returns_input(dtype):
    x = tf.cast(tf.reshape(tf.range(12), [4, 3]) - 5, dtype)
    out = api.allgather(x, name=f"gather/{dtype.name}")
    assert out.dtype == dtype
    np.testing.assert_array_equal(out.numpy(), x.numpy())


def test_allgather_in_graph_and_errors(op_calls):
    @tf.function
    def gather(x):
        return api.allgather(x, name="rows")

    np.testing.assert_array_equal(gather(tf.ones([3, 2])).numpy(), np.ones([3, 2]))
    assert [n for _, n, _ in op_calls] == ["Allgather/rows/counts", "Allgather/rows/data"]
    with pytest.raises(ValueError, match="at least one dimension"):
        api.allgather(tf.constant(1.0))


def test_broadcast_values_dtypes_and_root_check():
    for value in ([1.5, -2.0], [True, False], [3, 250]):
        x = tf.constant(value, tf.uint8) if value == [3, 250] else tf.constant(value)
        out = api.broadcast(x, root_rank=0)
        assert out.dtype == x.dtype
        np.testing.assert_array_equal(out.numpy(), x.numpy())
    with pytest.raises(ValueError, match="root_rank 1"):
        api.broadcast(tf.ones([1]), root_rank=1)


@pytest.mark.parametrize("obj", [{"lr": 0.1, "names": ["a", "b"]}, "abcde", None, list(range(1000))])
def test_broadcast_object_round_trip(obj):
    assert api.broadcast_object(obj, root_rank=0) == obj


def test_broadcast_variables_assigns_in_place_in_one_function(monkeypatch):
    names = []

    def plus_one(tensor, tensor_name, root_rank, priority=0, **kwargs):
        names.append((tensor_name, priority, tf.executing_eagerly()))
        return tensor + tf.cast(1, tensor.dtype)

    monkeypatch.setattr(bps_ops, "broadcast_raw", plus_one)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3, name="d")])
    counter = tf.Variable(5, dtype=tf.int64)
    before = [v.numpy().copy() for v in model.variables]
    api.broadcast_variables(model.variables + [counter], root_rank=0)
    for old, var in zip(before, model.variables):
        np.testing.assert_allclose(var.numpy(), old + 1)
    assert counter.numpy() == 6
    assert [n for n, _, _ in names][:2] == [f"BroadcastVariables/{model.variables[0].path}",
                                           f"BroadcastVariables/{model.variables[1].path}"]
    assert [p for _, p, _ in names] == [0, -1, -2]
    assert not any(eager for _, _, eager in names)   # traced: one function


# --------------------------------------------------------------------------
# DistributedGradientTape
# --------------------------------------------------------------------------
def _tiny_model(seed=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(2)])


def _plain_and_distributed_grads(run):
    model = _tiny_model()
    x = tf.random.stateless_normal([6, 5], seed=[1, 2])
    unused = tf.Variable(1.0, name="unused")
    sources = model.trainable_variables + [unused]

    def grads(distributed):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        if distributed:
            tape = DistributedGradientTape(tape)
        return tape.gradient(loss, sources)

    return run(lambda: grads(False)), run(lambda: grads(True))


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_tape_gradients_equal_plain_tape(mode, op_calls):
    run = (lambda f: f()) if mode == "eager" else (lambda f: tf.function(f)())
    plain, dist = _plain_and_distributed_grads(run)
    assert plain[-1] is None and dist[-1] is None      # unconnected passes through
    for p, d in zip(plain[:-1], dist[:-1]):
        np.testing.assert_allclose(d.numpy(), p.numpy(), rtol=1e-6)
    names = [n for _, n, _ in op_calls]
    assert names[0].startswith("PushPull/DistributedGradientTape/") and names[0].endswith("/kernel")
    assert [p for _, _, p in op_calls] == [0, -1, -2, -3]


def test_tape_averages_and_keeps_nested_structure(fake_size):
    fake_size(2)
    v = {"a": tf.Variable(2.0), "b": tf.Variable([1.0, 1.0])}
    with DistributedGradientTape(tf.GradientTape()) as tape:
        loss = v["a"] * 3.0 + tf.reduce_sum(v["b"]) * 4.0
    grads = tape.gradient(loss, v)
    assert isinstance(tape, tf.GradientTape)
    assert float(grads["a"]) == 1.5
    np.testing.assert_allclose(grads["b"].numpy(), [2.0, 2.0])


def test_tape_sparse_gradients_gathered_or_densified(op_calls):
    emb = keras.layers.Embedding(10, 3)
    ids = tf.constant([1, 4, 1])

    def grad(**kw):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(emb(ids))
        return DistributedGradientTape(tape, **kw).gradient(loss, emb.trainable_variables)[0]

    gathered = grad()
    assert isinstance(gathered, tf.IndexedSlices)
    np.testing.assert_array_equal(gathered.indices.numpy(), [1, 4, 1])
    assert any(n.startswith("Allgather/") for _, n, _ in op_calls)
    dense = grad(sparse_as_dense=True)
    assert isinstance(dense, tf.Tensor)
    np.testing.assert_array_equal(dense.numpy(), tf.convert_to_tensor(gathered).numpy())



def test_sparse_push_pull_averages_values_and_keeps_indices(fake_size):
    fake_size(2)
    slices = tf.IndexedSlices(tf.constant([[2.0, 4.0], [6.0, 8.0]]), tf.constant([3, 0]),
                              dense_shape=tf.constant([5, 2]))
    out = api.push_pull(slices, name="sparse")
    assert isinstance(out, tf.IndexedSlices)
    np.testing.assert_array_equal(out.values.numpy(), [[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_array_equal(out.indices.numpy(), [3, 0])
    np.testing.assert_array_equal(out.dense_shape.numpy(), [5, 2])
    summed = api.push_pull(slices, op=api.Sum, name="sparse_sum")
    np.testing.assert_array_equal(summed.values.numpy(), slices.values.numpy())

# --------------------------------------------------------------------------
# Keras DistributedOptimizer
# --------------------------------------------------------------------------
def _regression_data():
    rng = np.random.RandomState(0)
    x = rng.randn(64, 5).astype("float32")
    y = (x @ rng.randn(5, 2)).astype("float32")
    return x, y


def _fit(optimizer, epochs=2, callbacks=(), batch_size=16, seed=3):
    x, y = _regression_data()
    model = _tiny_model(seed)
    model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False,
                        verbose=0, callbacks=list(callbacks))
    return model, history


def test_distributed_optimizer_is_the_wrapped_class_and_keeps_config():
    base = keras.optimizers.Adam(learning_rate=0.02, beta_1=0.8, global_clipnorm=1.0)
    opt = bps_keras.DistributedOptimizer(base)
    assert isinstance(opt, keras.optimizers.Adam)
    assert type(opt).__name__ == "Adam"
    assert opt.get_config() == base.get_config()
    restored = type(opt).from_config(opt.get_config())
    assert isinstance(restored, type(opt))
    with pytest.raises(TypeError, match="Keras 3 optimizer"):
        bps_keras.DistributedOptimizer(object())


@pytest.mark.parametrize("make", [lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.5),
                                  lambda: keras.optimizers.SGD(0.05, momentum=0.9)],
                         ids=["adam", "sgd"])
def test_fit_with_distributed_optimizer_matches_plain(make, op_calls):
    plain, _ = _fit(make())
    dist, _ = _fit(bps_keras.DistributedOptimizer(make()))
    assert any(n.startswith("PushPull/DistributedOptimizer/") for _, n, _ in op_calls)
    for p, d in zip(plain.get_weights(), dist.get_weights()):
        np.testing.assert_allclose(d, p, atol=1e-6)


def test_distributed_optimizer_averages_in_apply_gradients(fake_size):
    fake_size(4)
    var = tf.Variable([1.0, 1.0])
    opt = bps_keras.DistributedOptimizer(keras.optimizers.SGD(1.0))
    opt.apply_gradients([(tf.constant([4.0, 8.0]), var)])
    np.testing.assert_allclose(var.numpy(), [0.0, -1.0])   # step with grad / 4


def test_backward_passes_per_step_sums_passes_like_horovod(op_calls):
    # Summing 2 passes of mean gradients == one SGD step with twice the rate.
    accumulated, _ = _fit(bps_keras.DistributedOptimizer(
        keras.optimizers.SGD(0.05), backward_passes_per_step=2), batch_size=8)
    reference, _ = _fit(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), batch_size=8)
    for a, r in zip(accumulated.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, r, atol=1e-6)
    averaged, _ = _fit(bps_keras.DistributedOptimizer(
        keras.optimizers.SGD(0.1), backward_passes_per_step=2,
        average_aggregated_gradients=True), batch_size=8)
    for a, r in zip(averaged.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, r, atol=1e-6)
    assert any(n.startswith("PushPull/DistributedOptimizer/") for _, n, _ in op_calls)


def test_no_second_reduction_inside_a_strategy(op_calls):
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        var = tf.Variable([1.0])
        opt = bps_keras.DistributedOptimizer(keras.optimizers.SGD(0.5))
        opt.build([var])

    @tf.function
    def step():
        strategy.run(lambda: opt.apply_gradients([(tf.constant([2.0]), var)]))

    step()
    assert op_calls == []
    np.testing.assert_allclose(var.numpy(), [0.0])


def test_saved_model_loads_as_plain_class_and_load_model_rewraps(tmp_path):
    model, _ = _fit(bps_keras.DistributedOptimizer(keras.optimizers.Adam(0.01)), epochs=1)
    path = str(tmp_path / "m.keras")
    model.save(path)
    plain = keras.models.load_model(path)
    assert type(plain.optimizer) is keras.optimizers.Adam
    wrapped = bps_keras.load_model(path)
    assert isinstance(wrapped.optimizer, keras.optimizers.Adam)
    assert type(wrapped.optimizer) is not keras.optimizers.Adam
    assert int(wrapped.optimizer.iterations.numpy()) == 4   # state kept


# --------------------------------------------------------------------------
# callbacks
# --------------------------------------------------------------------------
class _RecordLR(keras.callbacks.Callback):
    """Learning rate seen at each (epoch, batch) begin; must run after the
    callbacks under test."""

    def __init__(self):
        super().__init__()
        self.seen, self.epoch = {}, None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.seen[(self.epoch, batch)] = float(self.model.optimizer.learning_rate.numpy())


def test_warmup_follows_the_documented_formula(fake_size):
    fake_size(4)
    warmup = bps_callbacks.LearningRateWarmupCallback(0.8, warmup_epochs=2, verbose=0)
    fake_size(1)
    record = _RecordLR()
    _, history = _fit(keras.optimizers.SGD(0.123), epochs=3, callbacks=[warmup, record])
    steps = 4
    for (epoch, batch), lr in record.seen.items():
        frac = epoch + batch / steps
        expected = 0.8 / 4 * (frac * 3 / 2 + 1) if frac < 2 else 0.8
        assert lr == pytest.approx(expected, rel=1e-6), (epoch, batch)
    assert record.seen[(0, 0)] == pytest.approx(0.2)
    assert history.history["learning_rate"][-1] == pytest.approx(0.8)


def test_schedule_constant_and_function_multipliers():
    steps_of_lr = _RecordLR()
    sched = [bps_callbacks.LearningRateScheduleCallback(1.0, 0.5, start_epoch=1, end_epoch=3),
             bps_callbacks.LearningRateScheduleCallback(1.0, lambda e: 0.1 ** e, start_epoch=3)]
    _fit(keras.optimizers.SGD(0.01), epochs=5, callbacks=sched + [steps_of_lr])
    per_epoch = {e: lr for (e, b), lr in steps_of_lr.seen.items() if b == 0}
    assert per_epoch == pytest.approx({0: 0.01, 1: 0.5, 2: 0.5, 3: 1e-3, 4: 1e-4})


def test_schedule_not_staircase_changes_within_an_epoch():
    record = _RecordLR()
    cb = bps_callbacks.LearningRateScheduleCallback(1.0, lambda e: e + 1, staircase=False)
    _fit(keras.optimizers.SGD(0.01), epochs=1, callbacks=[cb, record])
    assert [record.seen[(0, b)] for b in range(4)] == pytest.approx([1.0, 1.25, 1.5, 1.75])


def test_lr_callbacks_refuse_a_schedule_object():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    cb = bps_callbacks.LearningRateScheduleCallback(0.1, 0.5)
    with pytest.raises(TypeError, match="LearningRateSchedule"):
        _fit(keras.optimizers.SGD(schedule), epochs=1, callbacks=[cb])


def test_metric_average_leaves_size_one_logs_unchanged_and_averages(fake_size):
    cb = bps_callbacks.MetricAverageCallback()
    logs = {"loss": 0.75, "val_loss": np.float32(1.5), "accuracy": 0.25, "note": "x"}
    cb.on_epoch_end(0, logs)
    assert logs == {"loss": 0.75, "val_loss": 1.5, "accuracy": 0.25, "note": "x"}
    fake_size(2)
    cb.on_epoch_end(1, logs)
    assert logs == {"loss": 0.375, "val_loss": 0.75, "accuracy": 0.125, "note": "x"}


def test_broadcast_callback_covers_model_and_optimizer_once(op_calls):
    cb = bps_callbacks.BroadcastGlobalVariablesCallback(0)
    model, _ = _fit(keras.optimizers.Adam(0.01), epochs=1, callbacks=[cb])
    names = {n for kind, n, _ in op_calls if kind == "broadcast"}
    for var in model.variables + model.optimizer.variables:
        assert f"BroadcastVariables/{var.path}" in names
    count = len(op_calls)
    model.fit(*_regression_data(), epochs=1, verbose=0, callbacks=[cb])
    assert len([c for c in op_calls[count:] if c[0] == "broadcast"]) == 0


def test_keras_namespace_matches_horovod_names():
    for name in ("init", "shutdown", "size", "rank", "local_size", "local_rank", "Average",
                 "Sum", "Compression", "DistributedOptimizer", "allreduce", "allgather",
                 "broadcast", "push_pull", "callbacks", "load_model"):
        assert hasattr(bps_keras, name), name
    with pytest.raises(NotImplementedError, match="BroadcastGlobalVariablesCallback"):
        bps_keras.broadcast_global_variables(0)
    # Eager code has no global variables: the TF1 op says what to use instead.
    with pytest.raises(RuntimeError, match="bps_tf.broadcast_variables"):
        bps_tf.broadcast_global_variables(0)
    out = bps_keras.allreduce(np.array([2.0, 4.0]), op=bps_keras.Sum, name="k")
    np.testing.assert_array_equal(out.numpy(), [2.0, 4.0])
    # The rest of horovod.tensorflow.keras' names, with its argument order.
    for name in ("reducescatter", "start_timeline", "stop_timeline", "mpi_threads_supported",
                 "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built",
                 "ddl_built", "ccl_built", "cuda_built", "rocm_built"):
        assert name in bps_keras.__all__ and callable(getattr(bps_keras, name)), name
    assert bps_keras.gloo_enabled() is False and bps_keras.mpi_threads_supported() is False
    rows = bps_keras.reducescatter(np.array([[1.0], [2.0]]), "k_rs", bps_keras.Sum)
    np.testing.assert_array_equal(rows.numpy(), [[1.0], [2.0]])   # one worker keeps every row


def test_broadcast_object_fn_returns_a_reusable_broadcast():
    bcast = bps_tf.broadcast_object_fn(root_rank=0, name="objfn")
    assert bcast({"epoch": 3}) == {"epoch": 3}
    assert bcast([1, "two"]) == [1, "two"]       # called again under the same name
    with pytest.raises(ValueError, match="root_rank"):
        bps_tf.broadcast_object_fn(root_rank=5)("x")


def test_byteps_argument_order_and_names_run_unchanged():
    # byteps.tensorflow: push_pull(tensor, scope, average, ...), broadcast(...,
    # scope, name, is_variable), broadcast_variables(variables, root, scope).
    x = tf.constant([2.0, 4.0])
    np.testing.assert_array_equal(api.push_pull(x, "Push_Pull").numpy(), [2.0, 4.0])
    np.testing.assert_array_equal(
        api.push_pull(x, scope="s", average=False, name="byteps_sum").numpy(), [2.0, 4.0])
    with pytest.raises(NotImplementedError, match="mode='async'"):
        api.push_pull(x, enable_async=True)
    np.testing.assert_array_equal(
        api.broadcast(x, 0, scope="s", name="byteps_bcast", is_variable=False).numpy(),
        [2.0, 4.0])
    v = tf.Variable([1.0, 3.0])
    api.broadcast_variables([v], 0, "scope")
    np.testing.assert_array_equal(v.numpy(), [1.0, 3.0])
    with pytest.raises(NotImplementedError, match="elastic training"):
        bps_tf.suspend()
    with pytest.raises(NotImplementedError, match="elastic training"):
        bps_tf.resume(2, 1)


def test_pushpull_speed_is_bytes_moved_per_window_as_bytepss(monkeypatch):
    # BytePS's get_pushpull_speed: (ms since the epoch, MB/s), measured over
    # windows of 10 s; (0, 0.0) until the first window closes.
    clock = {"now": 1000.0}
    moved = {"sent": 0, "received": 0}
    monkeypatch.setattr(basics.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(basics, "stats", lambda: {"bytes_sent": moved["sent"],
                                                  "bytes_received": moved["received"]})
    basics._speed_window_start()
    moved.update(sent=30_000_000, received=20_000_000)
    clock["now"] += 4.0
    assert bps_tf.get_pushpull_speed() == (0, 0.0)       # the window is still open
    clock["now"] += 6.0
    stamp, speed = bps_tf.get_pushpull_speed()           # 50 MB in 10 s
    assert speed == pytest.approx(5.0)
    assert abs(stamp / 1000 - time.time()) < 60
    assert bps_tf.get_pushpull_speed() == (stamp, speed)  # kept until the next window
    moved.update(sent=130_000_000)
    clock["now"] += 20.0
    assert bps_tf.get_pushpull_speed()[1] == pytest.approx(5.0)   # 100 MB in 20 s


def test_xla_compiled_code_is_refused_clearly():
    @tf.function(jit_compile=True)
    def compiled(x):
        return api.push_pull(x, name="xla")

    with pytest.raises(RuntimeError, match="jit_compile=False"):
        compiled(tf.ones([2]))


def test_async_mode_refuses_what_cannot_exchange_weights(monkeypatch):
    # A gradient tape never sees the optimizer's step, so it cannot push
    # weight changes: averaging gradients instead would not be async training.
    monkeypatch.setenv("BYTEPS_ENABLE_ASYNC", "1")
    from bps_tf.strategy import BytePSStrategy
    from bps_tf.horovod.tape import DistributedGradientTape
    w = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * w)
    with pytest.raises(NotImplementedError, match="exchanges weights, not gradients"):
        DistributedGradientTape(tape).gradient(loss, [w])
    from bps_tf.compat import v1
    from bps_tf.overlap import OverlappedApply
    with pytest.raises(NotImplementedError, match="OverlappedApply: asynchronous training"):
        OverlappedApply(None, None)
    with pytest.raises(NotImplementedError, match="enable_graph_rewrite: asynchronous training"):
        v1.enable_graph_rewrite()
    tf1_opt = v1.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    with pytest.raises(NotImplementedError, match="exchanges weights, not gradients"):
        tf1_opt.compute_gradients(lambda: tf.reduce_sum(w * w), var_list=[w])
    assert BytePSStrategy().mode == "async"   # BytePS's switch selects the mode
    with pytest.raises(ValueError, match="compression is not supported"):
        BytePSStrategy(mode="async", compression=api.Compression.fp16)
    with pytest.raises(ValueError, match="expected 'sync' or 'async'"):
        BytePSStrategy(mode="hogwild")


@pytest.mark.parametrize("obj", [{"a": [1, 2]}, "", None])
def test_allgather_object_one_worker_is_a_list_of_one(obj):
    assert api.allgather_object(obj) == [obj]


def test_predivide_scales_split_the_average_and_refuse_other_ops():
    assert api.predivide_scales(api.Average, 1.0, "x") == (1.0, 1.0)
    assert api.predivide_scales(api.Average, 4.0, "x") == (0.25, 4.0)
    with pytest.raises(ValueError, match="needs op=Average, got op=Sum"):
        api.predivide_scales(api.Sum, 2.0, "DistributedOptimizer")
    with pytest.raises(ValueError, match="must be > 0"):
        api.predivide_scales(api.Average, 0.0, "DistributedOptimizer")


def test_keras_distributed_optimizer_takes_gradient_predivide_factor():
    import keras
    from bps_tf.keras import DistributedOptimizer
    opt = DistributedOptimizer(keras.optimizers.SGD(0.1), gradient_predivide_factor=2.0)
    assert (opt._bps_prescale, opt._bps_postscale) == (0.5, 2.0)
    with pytest.raises(ValueError, match="op=Average"):
        DistributedOptimizer(keras.optimizers.SGD(0.1), op=api.Sum, gradient_predivide_factor=2.0)


def test_horovod_tf2_scripts_call_optimizer_variables():
    """Horovod's TF2 examples broadcast ``opt.variables()`` (Keras 2 made it a
    method; Keras 3 a list), and its elastic scripts set ``opt.lr`` (Keras 3
    has no such alias). After ``bps_tf.init()``, in a script that never
    imports bps_tf.keras, both work."""
    script = (
        "import tensorflow as tf, bps_tf\n"
        "bps_tf.init()\n"
        "opt = tf.optimizers.Adam(0.1)\n"
        "v = tf.Variable([1.0, 2.0])\n"
        "opt.apply_gradients([(tf.constant([0.5, 0.5]), v)])\n"
        "called = opt.variables()\n"
        "assert [id(x) for x in called] == [id(x) for x in opt.variables], called\n"
        "bps_tf.broadcast_variables(opt.variables(), root_rank=0)\n"
        "print('variables', len(called))\n"
        # Horovod's elastic scripts reset the rate with Keras 2's alias.
        "opt.lr.assign(0.25)\n"
        "print('lr', float(opt.learning_rate), float(opt.lr))\n"
        "opt.lr = 0.5\n"
        "print('lr set', float(opt.learning_rate))\n")
    proc = _run_alone(script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The step count, the learning rate and Adam's two slots.
    assert "variables 4" in proc.stdout, proc.stdout
    assert "lr 0.25 0.25" in proc.stdout and "lr set 0.5" in proc.stdout, proc.stdout


@pytest.mark.parametrize("make,reason", [
    (lambda: keras.optimizers.Nadam(0.01), "Nadam"),
    (lambda: keras.optimizers.Adam(0.01, global_clipnorm=1.0), "global_clipnorm"),
    (lambda: keras.optimizers.Adam(0.01, use_ema=True), "EMA"),
    (lambda: keras.optimizers.RMSprop(0.01), None),
    (lambda: keras.optimizers.Adafactor(0.01), None),
    (lambda: keras.optimizers.Adagrad(0.05), None),
    (lambda: keras.optimizers.Adadelta(1.0), None),
    (lambda: keras.optimizers.Adamax(0.01), None),
    (lambda: keras.optimizers.Ftrl(0.05), None),
    (lambda: keras.optimizers.Lion(0.001, weight_decay=0.01), None)],
    ids=["nadam", "global_clipnorm", "ema", "rmsprop", "adafactor", "adagrad", "adadelta",
         "adamax", "ftrl", "lion"])
def test_overlapped_apply_refuses_optimizers_it_cannot_defer_per_variable(make, reason):
    # Nadam advances one product per apply(): applying variable by variable
    # would advance it once per variable, a silently wrong schedule.
    from bps_tf.overlap import OverlappedApply, unsupported_reason
    found = unsupported_reason(make())
    if reason is None:
        assert found is None
        return
    assert reason in found
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="cannot defer"):
        OverlappedApply(model, make())


@pytest.mark.parametrize("passes", [0, 1.5, True])
def test_backward_passes_per_step_must_be_a_whole_number_of_passes(passes):
    # 1.5 once became 1 pass without a word; Keras 3 and TF1 optimizers refuse it.
    from bps_tf.keras import DistributedOptimizer
    for make in (lambda: keras.optimizers.SGD(0.1),
                 lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            DistributedOptimizer(make(), backward_passes_per_step=passes)


def test_a_negative_overlap_read_timeout_is_refused(monkeypatch):
    # It once meant "wait forever" without a word.
    from bps_tf.runtime import config
    monkeypatch.setenv("BYTEPS_OVERLAP_READ_TIMEOUT", "-5")
    with pytest.raises(ValueError, match="BYTEPS_OVERLAP_READ_TIMEOUT='-5' is not valid: it "
                                         "must be 0"):
        config.value("BYTEPS_OVERLAP_READ_TIMEOUT")


def test_overlapped_apply_refuses_an_unverified_optimizer_type_unless_allowed():
    # A subclass may read state shared by all variables in its update: as
    # model.fit keeps the barrier for it, OverlappedApply asks for an opt-in.
    from bps_tf.overlap import OverlappedApply

    class MyAdam(keras.optimizers.Adam):
        pass

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="MyAdam is not among the optimizers.*"
                                         "allow_unverified_optimizer=True"):
        OverlappedApply(model, MyAdam(0.01), prefix="unverified")
    overlap = OverlappedApply(model, MyAdam(0.01), prefix="allowed",
                              allow_unverified_optimizer=True)
    assert overlap.variables == model.trainable_variables


def _forget_data_hooks(monkeypatch):
    """The registry as if the end-of-data hooks were never installed."""
    from bps_tf.hooks import registry as hooks
    from bps_tf.strategy import data_check
    names = {h.name for h in hooks.hooks(data_check.GROUP)}
    monkeypatch.setattr(hooks, "_installed", hooks._installed - names)
    monkeypatch.setattr(hooks, "_missing", {})
    monkeypatch.setattr(hooks, "_warned", set())
    return hooks, data_check


def test_a_tensorflow_without_the_end_of_data_hook_keeps_its_own_sum(monkeypatch, caplog):
    # data_check wraps a private input_lib function; where a TensorFlow
    # has none, tf.distribute's own (blocking, exact) sum must stay in place.
    from tensorflow.python.distribute import input_lib
    hooks, data_check = _forget_data_hooks(monkeypatch)
    monkeypatch.delattr(input_lib, "_calculate_replicas_with_values")
    with caplog.at_level("WARNING", logger="bps_tf"):
        assert data_check.install() is False
        assert data_check.install() is False   # once per process: one warning
    assert "tf input_lib._calculate_replicas_with_values" in hooks.missing(data_check.GROUP)
    assert not hasattr(input_lib, "_calculate_replicas_with_values")
    assert len([r for r in caplog.records if "end-of-data sum" in r.getMessage()]) == 1


def test_the_end_of_data_hook_is_installed_once_and_serves_other_strategies_unchanged(
        monkeypatch):
    from tensorflow.python.distribute import input_lib
    hooks, data_check = _forget_data_hooks(monkeypatch)
    calls = []

    def original(strategy, input_workers, optional_list):
        calls.append(strategy)
        return "tf's own"

    monkeypatch.setattr(input_lib, "_calculate_replicas_with_values", original)
    assert data_check.install() is True
    patched = input_lib._calculate_replicas_with_values
    assert data_check.install() is True and input_lib._calculate_replicas_with_values is patched
    assert patched is not original
    other = tf.distribute.get_strategy()     # not a BytePSStrategy
    assert patched(other, None, []) == "tf's own" and calls == [other]


def test_join_in_a_function_runs_after_the_collectives_traced_before_it():
    # push_pulls are async stateful (not chained in program order): without
    # control dependencies a join traced after an allreduce could run first,
    # and the other workers' allreduce would count this worker as joined.
    @tf.function
    def reduce_then_join(x):
        first = bps_tf.allreduce(x, name="join_order/a", op=bps_tf.Sum)
        second = bps_tf.broadcast(x, 0, name="join_order/b")
        return first, second, bps_tf.join()

    graph = reduce_then_join.get_concrete_function(tf.TensorSpec([2], tf.float32)).graph
    ops = graph.get_operations()
    join = next(op for op in ops if op.name.startswith("BytePSJoin"))
    collectives_before = [op for op in ops if op.type in ("BytepsPushPull", "BytepsBroadcast")]
    assert len(collectives_before) >= 2
    assert set(collectives_before) <= set(join.control_inputs), join.control_inputs
    first, second, last = reduce_then_join(tf.constant([1.0, 2.0]))
    np.testing.assert_allclose(first.numpy(), [1.0, 2.0])
    np.testing.assert_allclose(second.numpy(), [1.0, 2.0])
    assert int(last) == 0
