"""Worker script for test_overlap.py: split push_pull and OverlappedApply.

    bpslaunch -np 2 --servers 2 python tests/workers/overlap_checks.py OUT_DIR

Every worker runs the same checks in the same order and writes
OUT_DIR/rank<r>.json ({"checks": {name: {"ok", "detail"}}}) after each one.
A failed check ends the worker at once (exit 3). The engine-failure check
runs last: it leaves a failed tensor behind in the cluster.
"""
import sys

import numpy as np
import tensorflow as tf
import keras

import bps_tf
from bps_tf.comm import collectives
from bps_tf.overlap import OverlappedApply
from bps_tf.horovod.tape import DistributedGradientTape
from check_record import Checks  # noqa: E402

STEPS = 6


class Marker(keras.layers.Layer):
    """Identity that ends a debug hold once the layer before it has run."""

    def call(self, x):
        return collectives.debug_marker(x)


def make_model():
    keras.utils.set_random_seed(7)   # same initial weights on every worker and run
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu"),
        Marker(),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(3),
    ])


def batches(rank):
    rng = np.random.default_rng(100 + rank)   # different data per worker
    return [(rng.standard_normal((32, 8)).astype("float32"),
             rng.standard_normal((32, 3)).astype("float32")) for _ in range(STEPS)]


def loss_fn(y, pred):
    return tf.reduce_mean(tf.square(y - pred))


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05),
    "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw_schedule": lambda: keras.optimizers.AdamW(
        keras.optimizers.schedules.ExponentialDecay(0.01, 2, 0.5), weight_decay=0.01,
        clipnorm=1.0),
    "rmsprop_centered": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
}


def state(model, optimizer):
    return ([np.array(v.numpy()) for v in model.trainable_variables],
            [np.array(v.numpy()) for v in optimizer.variables])


def reference(opt_name, data):
    model, optimizer = make_model(), OPTIMIZERS[opt_name]()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    for x, y in data:
        step(x, y)
    return state(model, optimizer)


def overlapped(opt_name, data, prefix, steps_per_call=1, hold_at=None, rank=0):
    model, optimizer = make_model(), OPTIMIZERS[opt_name]()
    overlap = OverlappedApply(model, optimizer, prefix=prefix)
    info = {}

    @tf.function
    def step(xs, ys):
        for x, y in zip(xs, ys):   # steps_per_call steps unrolled in one graph
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            overlap.start(grads)
        return loss

    for k in range(0, len(data), steps_per_call):
        chunk = data[k:k + steps_per_call]
        if hold_at is not None and k == hold_at and rank == 0:
            # The last variable's sum of this step is kept from its wait
            # until the next step's first layer has run (or 10 s pass).
            collectives.debug_hold_push_pull(overlap.keys[-1], 10000)
        step([c[0] for c in chunk], [c[1] for c in chunk])
    info["pending_before_flush"] = overlap.pending()
    info["flushed"] = overlap.flush()
    info["pending_after_flush"] = overlap.pending()
    info["state"] = state(model, optimizer)
    info["iterations"] = int(optimizer.iterations.numpy())
    info["second_flush"] = overlap.flush()
    info["state2"] = state(model, optimizer)
    info["overlap"] = overlap
    return info


def expect_bits(what, got, want):
    if len(got) != len(want):
        raise AssertionError(f"{what}: {len(got)} arrays, want {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape or g.tobytes() != w.tobytes():
            diff = np.max(np.abs(g.astype(np.float64) - w.astype(np.float64))) \
                if g.shape == w.shape else "shape"
            raise AssertionError(f"{what}[{i}] differs (max abs diff {diff})")


def check_exact(opt_name, rank, steps_per_call=1, hold_at=None):
    def run():
        data = batches(rank)
        want_w, want_o = reference(opt_name, data)
        got = overlapped(opt_name, data, f"{opt_name}.spc{steps_per_call}",
                         steps_per_call, hold_at, rank)
        expect_bits("weights", got["state"][0], want_w)
        expect_bits("optimizer variables", got["state"][1], want_o)
        if got["iterations"] != STEPS:
            raise AssertionError(f"iterations {got['iterations']}, want {STEPS}")
        n_vars = len(want_w)
        if got["flushed"] != n_vars:
            raise AssertionError(f"flush applied {got['flushed']} updates, want {n_vars}; "
                                 f"pending before: {got['pending_before_flush']}, keys "
                                 f"{got['overlap'].keys}")
        if got["pending_after_flush"]:
            raise AssertionError(f"pending after flush: {got['pending_after_flush']}")
        if got["second_flush"] != 0:
            raise AssertionError(f"second flush applied {got['second_flush']}")
        expect_bits("weights after a second flush", got["state2"][0], want_w)
        expect_bits("optimizer after a second flush", got["state2"][1], want_o)
        detail = {"vars": n_vars, "steps": STEPS}
        if hold_at is not None:
            detail["pending_before_flush"] = got["pending_before_flush"]
            detail["keys"] = got["overlap"].keys
        return detail
    return run


def check_reads_between_steps(rank):
    """Between OverlappedApply steps, a kernel's numpy() and a tf.function
    summing the weights directly (no layer call) see the weights the
    barrier's loop has after the same step, bit for bit."""
    def run():
        data = batches(rank)
        seen = {}
        for label in ("barrier", "overlap"):
            model, optimizer = make_model(), OPTIMIZERS["adam"]()
            variables = model.trainable_variables
            total = tf.function(lambda: tf.add_n([tf.reduce_sum(v) for v in variables]))
            if label == "overlap":
                overlap = OverlappedApply(model, optimizer, prefix="reads")

                @tf.function
                def step(x, y):
                    with tf.GradientTape() as tape:
                        loss = loss_fn(y, model(x, training=True))
                    overlap.start(tape.gradient(loss, variables))
                    return loss
            else:
                @tf.function
                def step(x, y):
                    with tf.GradientTape() as tape:
                        loss = loss_fn(y, model(x, training=True))
                    grads = DistributedGradientTape(tape).gradient(loss, variables)
                    optimizer.apply(grads, variables)
                    return loss
            reads = []
            for k, (x, y) in enumerate(data):
                step(x, y)
                if k % 2:
                    reads.append(np.array(variables[-2].numpy()))
                else:
                    reads.append(np.array(total().numpy()))
            seen[label] = reads
        expect_bits("reads between steps", seen["overlap"], seen["barrier"])
        return {"reads": len(seen["overlap"])}
    return run


def check_start_twice(rank):
    def run():
        key = "Overlap/test/twice"
        x = tf.constant([1.0, 2.0])
        collectives.push_pull_start(x, key)
        try:
            collectives.push_pull_start(x, key)
        except tf.errors.FailedPreconditionError as exc:
            if key not in str(exc):
                raise AssertionError(f"error does not name the key: {exc}")
        else:
            raise AssertionError("a second start of a pending key did not fail")
        summed, valid = collectives.push_pull_wait(tf.zeros([2]), key)
        want = np.array([1.0, 2.0]) * 2
        if not bool(valid) or not np.array_equal(summed.numpy(), want):
            raise AssertionError(f"sum {summed.numpy()} valid {bool(valid)}")
        summed, valid = collectives.push_pull_wait(tf.zeros([2]), key)
        if bool(valid) or np.any(summed.numpy() != 0):
            raise AssertionError("a second wait found something pending")
        return ""
    return run


def check_hold_log(rank):
    def run():
        return {"log": collectives.debug_hold_log()}
    return run


def check_engine_failure(rank):
    def run():
        # The workers send different sizes under one key: the engine fails
        # the push_pull, and the wait must raise that error.
        key = "Overlap/test/mismatch"
        collectives.push_pull_start(tf.ones([rank + 1]), key)
        try:
            collectives.push_pull_wait(tf.zeros([rank + 1]), key)
        except tf.errors.OpError as exc:
            if key not in str(exc):
                raise AssertionError(f"the error does not name the key: {exc}")
            pending = collectives.pending_push_pulls()
            if key in pending:
                raise AssertionError(f"the failed key is still pending: {pending}")
            return {"error": type(exc).__name__, "message": str(exc)[:300]}
        raise AssertionError("a wait for a failed push_pull returned")
    return run


def main():
    out_dir = sys.argv[1]
    bps_tf.init()
    rank, size = bps_tf.rank(), bps_tf.size()
    checks = Checks(out_dir, rank, size)
    checks.run("start_twice", check_start_twice(rank))
    checks.run("exact_sgd", check_exact("sgd", rank, hold_at=3))
    checks.run("hold_log", check_hold_log(rank))
    checks.run("exact_momentum", check_exact("momentum", rank))
    checks.run("exact_adam", check_exact("adam", rank))
    checks.run("exact_adam_2_steps_per_call", check_exact("adam", rank, steps_per_call=2))
    checks.run("exact_adamw_schedule_clipnorm", check_exact("adamw_schedule", rank))
    checks.run("exact_rmsprop_centered", check_exact("rmsprop_centered", rank))
    checks.run("reads_between_steps", check_reads_between_steps(rank))
    checks.run("engine_failure", check_engine_failure(rank))
    bps_tf.shutdown()


if __name__ == "__main__":
    main()
