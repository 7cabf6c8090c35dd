"""Worker script for test_compression_cluster.py: the core's compressors across
real processes, every face, in one cluster.

    bpslaunch -np 2 --servers 2 python tests/workers/compression_checks.py OUT_DIR

BYTEPS_PARTITION_BYTES=4096 (1,024 float32 per partition, spread over both
servers) and BYTEPS_MIN_COMPRESS_BYTES=4096. Expectations are exact: each
is the numpy reference of what the workers compress, the servers sum in
float32 and re-compress (tests/test_compression.py checks the references
against the core bit for bit). Writes OUT_DIR/rank<r>.json (check_record).
"""
import os
import sys

import numpy as np
import tensorflow as tf
import keras

import bps_tf
from bps_tf.horovod import api
from bps_tf.runtime import basics
from bps_tf.horovod.tape import DistributedGradientTape
from check_record import Checks  # noqa: E402

PART = 1024        # float32 elements per partition
N = 2 * PART       # two partitions: one on each server


def expect_equal(what, got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or not np.array_equal(got, want):
        bad = np.argwhere(got != want)[:3].tolist() if got.shape == want.shape else "shape"
        raise AssertionError(f"{what}: first differences at {bad}: got "
                             f"{got.reshape(-1)[:6]}, want {want.reshape(-1)[:6]}")


def per_partition(fn, *arrays):
    return np.concatenate([fn(*(a[p:p + PART] for a in arrays)) for p in range(0, N, PART)])


def onebit(x):
    scale = np.float32(np.add.accumulate(np.abs(x.astype(np.float64)))[-1] / x.size)
    return np.where(x < 0, -scale, scale).astype(np.float32)


def topk(x, k):
    keep = np.lexsort((np.arange(x.size), -np.abs(x)))[:k]
    out = np.zeros_like(x)
    out[keep] = x[keep]
    return out


def worker_values(rank):
    """Signs and magnitudes that differ per worker: integers, so every sum is exact."""
    i = np.arange(N)
    sign = np.where((i * (rank + 3)) % 7 < 3, -1.0, 1.0)
    return (sign * (1 + (i + rank) % 4)).astype(np.float32)


def check_onebit_push_pull(rank, size):
    xs = [worker_values(r) for r in range(size)]
    got = api.push_pull(tf.constant(xs[rank]), op=api.Sum, name="c/onebit",
                        compression=api.Compression.onebit()).numpy()
    summed = sum(per_partition(onebit, x) for x in xs)      # server: float32 sum
    expect_equal("onebit sum", got, per_partition(onebit, summed))
    return f"{np.unique(got).tolist()}"


def check_topk_push_pull(rank, size):
    xs = [(worker_values(r) * (1 + np.arange(N) % 13)).astype(np.float32) for r in range(size)]
    k = int(np.ceil(0.01 * PART))
    got = api.push_pull(tf.constant(xs[rank]), op=api.Average, name="c/topk",
                        compression=api.Compression.topk(0.01)).numpy()
    summed = sum(per_partition(lambda x: topk(x, k), x) for x in xs)
    expect_equal("topk average", got, per_partition(lambda x: topk(x, k), summed) / size)
    return f"nonzeros {int(np.count_nonzero(got))}"


def check_randomk_same_indices(rank, size):
    xs = [np.abs(worker_values(r)) for r in range(size)]     # no zero anywhere
    got = api.push_pull(tf.constant(xs[rank]), op=api.Sum, name="c/randomk",
                        compression=api.Compression.randomk(0.05, seed=11)).numpy()
    k = int(np.ceil(0.05 * PART))
    total = sum(xs)
    for p in range(0, N, PART):
        chosen = np.flatnonzero(got[p:p + PART])
        # Every worker drew the same indices, so the sum has k nonzeros and
        # the server's re-compression (same stream) keeps all of them.
        expect_equal("randomk count", len(chosen), k)
        expect_equal("randomk values", got[p:p + PART][chosen], total[p:p + PART][chosen])
    return f"k={k}"


def check_dithering_exact_on_equal_magnitudes(rank, size):
    # |x| == max|x| everywhere: every level rounds to `levels` whatever the draw.
    x = np.where(np.arange(N) % 3 == 0, -2.0, 2.0).astype(np.float32)
    got = api.push_pull(tf.constant(x), op=api.Sum, name="c/dithering",
                        compression=api.Compression.dithering(4, seed=3)).numpy()
    expect_equal("dithering sum", got, x * size)
    return "ok"


def simulate_error_feedback(spec, gs, steps):
    """Per step, what the cluster returns: each worker's and each server's
    residual kept by the core's own CompressorState, per partition."""
    core = basics.core()
    out = []
    workers = [[core.CompressorState() for _ in range(0, N, PART)] for _ in gs]
    servers = [core.CompressorState() for _ in range(0, N, PART)]
    for step in range(steps):
        parts = []
        for i, p in enumerate(range(0, N, PART)):
            acc = sum(core.decompress(spec, workers[r][i].encode(spec, g[p:p + PART], 0, PART,
                                                                 step), PART)
                      for r, g in enumerate(gs)).astype(np.float32)
            parts.append(core.decompress(spec, servers[i].encode(spec, acc, 0, PART, step,
                                                                 False), PART))
        out.append(np.concatenate(parts))
    return out


def check_error_feedback_converges(rank, size):
    gs = [np.random.default_rng(r).standard_normal(N).astype(np.float32) for r in range(size)]
    comp = api.Compression.topk(0.1, error_feedback=True)
    steps, mean = 80, np.zeros(N, np.float64)
    want = simulate_error_feedback(comp.spec, gs, steps)
    for step in range(steps):
        got = api.push_pull(tf.constant(gs[rank]), op=api.Sum, name="c/ef", compression=comp)
        expect_equal(f"error feedback step {step}", got.numpy(), want[step])
        mean += got.numpy()
    total = sum(gs)
    err = np.max(np.abs(mean / steps - total)) / np.max(np.abs(total))
    # Without error feedback 90% of every partition would never arrive.
    assert err < 0.1, err
    return f"relative error {err:.4f} after {steps} steps"


def check_uncompressed_cases(rank, size):
    comp = api.Compression.onebit()
    small = np.arange(100, dtype=np.float32) * (rank + 1)     # under 4096 bytes
    got = api.push_pull(tf.constant(small), op=api.Sum, name="c/small", compression=comp)
    expect_equal("small tensor", got.numpy(), np.arange(100) * sum(range(1, size + 1)))
    wide = np.arange(N, dtype=np.float64) * (rank + 1)       # not float32
    got = api.push_pull(tf.constant(wide), op=api.Sum, name="c/f64", compression=comp)
    expect_equal("float64 tensor", got.numpy(), np.arange(N) * sum(range(1, size + 1)))
    return "ok"


def check_bytes_on_the_wire(rank, size):
    x = tf.constant(worker_values(rank).repeat(128))       # 1 MiB
    before = basics.stats()["bytes_sent"]
    api.push_pull(x, op=api.Sum, name="c/wire", compression=api.Compression.topk(0.01))
    sent = basics.stats()["bytes_sent"] - before
    raw = x.shape.num_elements() * 4
    assert sent < 0.03 * raw, (sent, raw)      # 1% of indices + values: 2% and headers
    return f"{sent} bytes for {raw}"


def check_workers_disagree(rank, size):
    comp = api.Compression.topk(0.01 if rank == 0 else 0.02)
    try:
        api.push_pull(tf.ones([N]), op=api.Sum, name="c/disagree", compression=comp)
    except Exception as exc:   # the scheduler's error, on every worker
        text = str(exc)
        assert "topk ratio=0.01" in text and "topk ratio=0.02" in text, text
        return text[:300]
    raise AssertionError("workers with different compressors were not refused")


def check_tape(rank, size):
    w = tf.Variable(tf.ones([N]))
    x = tf.constant(worker_values(rank))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * x)
    tape = DistributedGradientTape(tape, compression=api.Compression.onebit())
    (grad,) = tape.gradient(loss, [w])
    xs = [worker_values(r) for r in range(size)]
    want = per_partition(onebit, sum(per_partition(onebit, v) for v in xs)) / size
    expect_equal("tape onebit gradient", grad.numpy(), want)
    return "ok"


def dense_model():
    keras.utils.set_random_seed(5)
    return keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(4)])


def data(rank):
    rng = np.random.default_rng(100 + rank)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    return x, (x[:, :4] * 2.0).astype(np.float32)


def weights_digest(model):
    return [w.tolist() for w in np.concatenate([v.numpy().reshape(-1)
                                                for v in model.weights])[:: 97]]


def check_keras_distributed_optimizer(rank, size):
    from bps_tf.keras import DistributedOptimizer
    model = dense_model()
    opt = DistributedOptimizer(keras.optimizers.SGD(0.05),
                               compression=api.Compression.dithering(8, error_feedback=True))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    x, y = data(rank)
    hist = model.fit(x, y, epochs=3, batch_size=16, verbose=0).history["loss"]
    assert hist[-1] < hist[0], hist
    return {"loss": hist, "weights": weights_digest(model)}


def check_strategy_fit_topk(rank, size):
    from bps_tf.strategy import BytePSStrategy
    strategy = BytePSStrategy(compression=api.Compression.topk(0.1, error_feedback=True))
    with strategy.scope():
        model = dense_model()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=False)
    x, y = data(rank)
    before = basics.stats()["bytes_sent"]
    hist = model.fit(x, y, epochs=3, batch_size=16, verbose=0).history["loss"]
    sent = basics.stats()["bytes_sent"] - before
    steps = int(model.optimizer.iterations.numpy())
    raw = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights) * steps
    assert hist[-1] < hist[0], hist
    # The 32x64 kernel (8 KiB) is compressed; the small ones travel as they are.
    assert sent < 0.6 * raw, (sent, raw)
    return {"loss": hist, "weights": weights_digest(model), "bytes": [sent, raw]}


def _not_gradients(strategy, rank, size):
    """What the strategy reduces besides gradients, under ``strategy``: a
    user's all_reduce of 4,096 floats, a strategy.reduce, a 32-class MeanIoU
    (a 4 KiB confusion matrix) and SyncBatchNormalization's outputs."""
    from bps_tf.horovod.sync_batch_norm import SyncBatchNormalization
    mine = np.arange(4096, dtype=np.float32) * (rank + 1)

    @tf.function
    def user_all_reduce():
        def body():
            ctx = tf.distribute.get_replica_context()
            return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.constant(mine))
        return strategy.run(body)
    reduced = strategy.experimental_local_results(user_all_reduce())[0].numpy()
    per_replica = strategy.run(lambda: tf.constant(mine))
    summed = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None).numpy()
    rng = np.random.default_rng(7)
    labels = rng.integers(0, 32, 512)
    preds = np.where(rng.random(512) < 0.7, labels, rng.integers(0, 32, 512))
    with strategy.scope():
        keras.utils.set_random_seed(9)
        inputs = keras.Input((32,))
        model = keras.Model(inputs, SyncBatchNormalization()(inputs))
        iou = keras.metrics.MeanIoU(num_classes=32, sparse_y_true=True, sparse_y_pred=True)
    x = rng.standard_normal((64, 32)).astype(np.float32) + rank
    bn = strategy.experimental_local_results(
        strategy.run(tf.function(lambda: model(tf.constant(x), training=True))))[0].numpy()

    @tf.function
    def update():
        return strategy.run(lambda: iou.update_state(tf.constant(labels), tf.constant(preds)))
    update()
    return {"all_reduce": reduced.tolist(), "reduce": summed.tolist(),
            "mean_iou": float(iou.result().numpy()), "sync_bn": bn[:4].tolist(),
            "want_all_reduce": (np.arange(4096) * sum(range(1, size + 1))).tolist()}


def check_strategy_compresses_gradients_only(rank, size):
    from bps_tf.strategy import BytePSStrategy
    plain = _not_gradients(BytePSStrategy(), rank, size)
    compressed = _not_gradients(
        BytePSStrategy(compression=api.Compression.topk(0.01, error_feedback=True)), rank, size)
    expect_equal("user all_reduce", np.array(compressed["all_reduce"]),
                 np.array(compressed["want_all_reduce"]))
    expect_equal("strategy.reduce", np.array(compressed["reduce"]),
                 np.array(compressed["want_all_reduce"]))
    assert abs(compressed["mean_iou"] - plain["mean_iou"]) < 1e-6, (compressed, plain)
    np.testing.assert_allclose(compressed["sync_bn"], plain["sync_bn"], rtol=1e-6, atol=1e-6)
    return {"mean_iou": [plain["mean_iou"], compressed["mean_iou"]]}


def check_resume_warning(rank, size, out_dir):
    """BackupAndRestore finding a backup of a model trained with a stateful
    compressor warns once that the compressor's state starts afresh."""
    import logging
    from bps_tf.strategy import BytePSStrategy
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
    logging.getLogger("bps_tf").addHandler(Keep())
    backup = os.path.join(out_dir, "backup")
    strategy = BytePSStrategy(compression=api.Compression.topk(0.1, error_feedback=True))
    with strategy.scope():
        model = dense_model()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=False)
    x, y = data(rank)
    keep = keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)
    model.fit(x, y, epochs=1, batch_size=16, verbose=0, callbacks=[keep])
    assert not [m for m in seen if "start again from zero" in m], seen
    model.fit(x, y, epochs=2, batch_size=16, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    warnings = [m for m in seen if "start again from zero" in m]
    assert len(warnings) == 1 and "resumed run is not bit-identical" in warnings[0], seen
    return warnings[0]


def main(out_dir):
    bps_tf.init()
    rank, size = bps_tf.rank(), bps_tf.size()
    checks = Checks(out_dir, rank, size)
    checks.run("onebit", lambda: check_onebit_push_pull(rank, size))
    checks.run("topk", lambda: check_topk_push_pull(rank, size))
    checks.run("randomk", lambda: check_randomk_same_indices(rank, size))
    checks.run("dithering", lambda: check_dithering_exact_on_equal_magnitudes(rank, size))
    checks.run("error_feedback", lambda: check_error_feedback_converges(rank, size))
    checks.run("uncompressed", lambda: check_uncompressed_cases(rank, size))
    checks.run("wire_bytes", lambda: check_bytes_on_the_wire(rank, size))
    checks.run("disagree", lambda: check_workers_disagree(rank, size))
    checks.run("tape", lambda: check_tape(rank, size))
    checks.run("keras_optimizer", lambda: check_keras_distributed_optimizer(rank, size))
    checks.run("strategy_fit", lambda: check_strategy_fit_topk(rank, size))
    checks.run("gradients_only",
               lambda: check_strategy_compresses_gradients_only(rank, size))
    checks.run("resume_warning", lambda: check_resume_warning(rank, size, out_dir))
    checks.results["finished"] = {"ok": True, "detail": ""}
    checks.write()


if __name__ == "__main__":
    main(sys.argv[1])
