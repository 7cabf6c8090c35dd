"""Horovod's join across real workers, run by tests/test_join.py (2 workers)
and by tests/workers/tf_checks.py (3 workers) in their clusters.

Ranks run different numbers of steps and then join; every expectation is
computed with numpy from the steps each rank takes (a joined rank counts as
zeros; an Average divides by size(), as Horovod does).

    bpslaunch -np 2 --servers 2 python tests/workers/join_checks.py OUT_DIR
"""
import os
import sys

import numpy as np
import tensorflow as tf
import keras

import bps_tf
import bps_tf.runtime.basics  # noqa: F401  (stats)
from bps_tf.horovod import api
from bps_tf.horovod.tape import DistributedGradientTape


def expect_equal(what, got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or not np.array_equal(got, want):
        raise AssertionError(f"{what}: got {got.tolist()}, want {want.tolist()}")


def _value(rank, step):
    return np.asarray([rank + 1, 2 * (rank + 1) + step, -3 - rank], np.int64)


def _uneven_epoch(rank, size, steps_of, tag, join_in_function=False):
    """Every rank runs steps_of(rank) steps of Sum, Average, Min and Max
    (eager and inside a tf.function), then joins (eagerly, or inside a
    tf.function); returns join's value."""
    @tf.function
    def in_function(x):
        return (api.allreduce(x, op=api.Sum, name=f"join/{tag}/fn_sum"),
                api.allreduce(tf.cast(x, tf.float32), op=api.Average,
                              name=f"join/{tag}/fn_avg"))

    for step in range(steps_of(rank)):
        active = [r for r in range(size) if steps_of(r) > step]
        every = np.stack([_value(r, step) for r in active])
        x = tf.constant(_value(rank, step), tf.int32)
        expect_equal(f"{tag} step {step} sum", api.allreduce(x, op=api.Sum, name=f"join/{tag}/sum"),
                     every.sum(0))
        avg = api.allreduce(tf.cast(x, tf.float64), op=api.Average, name=f"join/{tag}/avg")
        expect_equal(f"{tag} step {step} average", avg, every.sum(0) / size)
        # A joined rank contributes zeros to a min or max too (as in Horovod).
        with_zeros = every if len(active) == size else np.vstack([every, np.zeros([1, 3])])
        expect_equal(f"{tag} step {step} min",
                     api.allreduce(x, op=api.Min, name=f"join/{tag}/min"), with_zeros.min(0))
        expect_equal(f"{tag} step {step} max",
                     api.allreduce(x, op=api.Max, name=f"join/{tag}/max"), with_zeros.max(0))
        fn_sum, fn_avg = in_function(x)
        expect_equal(f"{tag} step {step} function sum", fn_sum, every.sum(0))
        if not np.allclose(fn_avg.numpy(), every.sum(0) / size, rtol=1e-6, atol=0):
            raise AssertionError(f"{tag} step {step} function average: {fn_avg.numpy()}")
    if join_in_function:
        return int(tf.function(lambda: bps_tf.join())().numpy())
    return bps_tf.join()


def _expect_join_seen(what, ranks):
    seen = bps_tf.runtime.basics.stats()["join_seen_sent"]
    if seen != sum(1 << k for k in ranks):
        raise AssertionError(f"{what}: this worker's notice said it saw the joins of "
                             f"{bin(seen)}, want ranks {ranks}")


def check_join_uneven_steps_and_again(rank, size):
    """Two epochs: the highest rank runs longest, then the lowest; join
    returns the rank that joined last, the same on every rank; in between
    and afterwards every collective counts every rank again."""
    last = _uneven_epoch(rank, size, lambda r: r + 1, "epoch1")
    if last != size - 1:
        raise AssertionError(f"first join returned {last}, want {size - 1}")
    # The scheduler names the last from what each worker's results counted:
    # rank r's last step completed with every rank that ran fewer steps
    # counted as joined, and with none that ran more.
    _expect_join_seen("first join", [k for k in range(size) if k < rank])
    full = api.allreduce(tf.constant([rank + 1]), op=api.Sum, name="join/between")
    expect_equal("sum between joins", full, [size * (size + 1) // 2])
    # The same names again: each rank's own round numbers still match.
    last = _uneven_epoch(rank, size, lambda r: size - r, "epoch1", join_in_function=True)
    if last != 0:
        raise AssertionError(f"second join returned {last}, want 0")
    _expect_join_seen("second join", [k for k in range(size) if k > rank])
    got = api.allgather(tf.constant([[rank]]), name="join/after")
    expect_equal("allgather after the joins", got, [[r] for r in range(size)])
    return f"{last}"


def check_broadcast_and_allgather_refused_under_join(rank, size):
    """Rank 0 (the root) joins at once: the others' broadcast from it and
    allgather fail on every rank that calls them (Horovod refuses both
    under join), then they join too and a broadcast works again."""
    errors = []
    if rank != 0:
        for call in (lambda: api.broadcast(tf.constant([float(rank)]), root_rank=0,
                                           name="join/bcast"),
                     lambda: api.allgather(tf.constant([[rank]]), name="join/gather")):
            try:
                call()
            except tf.errors.FailedPreconditionError as exc:
                if "joined" not in str(exc):
                    raise AssertionError(f"refusal does not say why: {exc}") from exc
                errors.append("refused")
            else:
                raise AssertionError("a collective that Horovod refuses under join completed")
    bps_tf.join()
    got = api.broadcast(tf.constant([float(rank)]), root_rank=0, name="join/bcast_after")
    expect_equal("broadcast after join", got, [0.0])
    return " ".join(errors) or "root"


def _batches(rank, count):
    rng = np.random.default_rng(100 + rank)
    return [(rng.normal(size=(4, 3)).astype(np.float32),
             rng.normal(size=(4, 1)).astype(np.float32)) for _ in range(count)]


def check_join_with_gradient_tape_training(rank, size):
    """DistributedGradientTape training where rank r has r + 2 batches: at
    each step the gradient is the sum over the ranks still training divided
    by size(); checked against the same steps computed in one process."""
    steps_of = [r + 2 for r in range(size)]
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    reference = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    api.broadcast_variables(model.variables, root_rank=0)
    reference.set_weights(model.get_weights())
    loss_fn = keras.losses.MeanSquaredError()
    opt = keras.optimizers.SGD(0.1)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        tape = DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for x, y in _batches(rank, steps_of[rank]):
        step(x, y)
    bps_tf.join()
    return _compare_with_reference(model, reference, loss_fn, rank, size, steps_of)


def _compare_with_reference(model, reference, loss_fn, rank, size, steps_of):
    """Runs this rank's steps on ``reference`` in one process (the gradient
    of each step summed over the ranks still training, divided by size(),
    SGD(0.1)) and compares the weights with ``model``'s."""
    every = {r: _batches(r, steps_of[r]) for r in range(size)}
    for s in range(steps_of[rank]):
        total = None
        for r in range(size):
            if s >= steps_of[r]:
                continue
            x, y = every[r][s]
            with tf.GradientTape() as tape:
                loss = loss_fn(y, reference(x))
            grads = tape.gradient(loss, reference.trainable_variables)
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        for var, g in zip(reference.trainable_variables, total):
            var.assign_sub(0.1 * g / size)
    worst = max(float(np.max(np.abs(a - b)))
                for a, b in zip(model.get_weights(), reference.get_weights()))
    if worst > 1e-5:
        raise AssertionError(f"weights differ from the reference by {worst}")
    return f"max difference {worst:.2e}"


def check_join_with_distributed_optimizer_fit(rank, size):
    """model.fit with bps_tf.keras.DistributedOptimizer where rank r has
    r + 2 batches, then join: the same steps as in one process."""
    import bps_tf.keras as bps_keras
    steps_of = [r + 2 for r in range(size)]
    keras.utils.set_random_seed(11)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    reference = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    bps_keras.broadcast_model(model, root_rank=0)
    reference.set_weights(model.get_weights())
    loss_fn = keras.losses.MeanSquaredError()
    model.compile(optimizer=bps_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss=loss_fn, jit_compile=False)
    batches = _batches(rank, steps_of[rank])
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    bps_tf.join()
    return _compare_with_reference(model, reference, loss_fn, rank, size, steps_of)


def run_all(checks, rank, size):
    """Runs every join check through ``checks.run`` (check_record.Checks)."""
    checks.run("join_uneven_steps", lambda: check_join_uneven_steps_and_again(rank, size))
    checks.run("join_refuses_broadcast_allgather",
               lambda: check_broadcast_and_allgather_refused_under_join(rank, size))
    checks.run("join_tape_training", lambda: check_join_with_gradient_tape_training(rank, size))
    checks.run("join_fit_distributed_optimizer",
               lambda: check_join_with_distributed_optimizer_fit(rank, size))


def main(out_dir):
    import parity_checks
    from check_record import Checks
    bps_tf.init()
    rank, size = bps_tf.rank(), bps_tf.size()
    checks = Checks(out_dir, rank, size)
    run_all(checks, rank, size)
    # Min/Max/Product on the servers, at this cluster's size (2 workers).
    checks.run("parity_allreduce",
               lambda: parity_checks.check_allreduce_every_dtype_and_op(rank, size))
    checks.run("parity_server_reductions",
               lambda: parity_checks.check_server_reductions(rank, size))
    checks.run("finished", lambda: "ok")
    bps_tf.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1])
