"""Worker script for test_priority_pass.py (run under bpslaunch, timeline on).

    bpslaunch -np 2 --servers 1 python tests/workers/priority_checks.py OUT_DIR

Scenarios, in one process so one cluster serves them all; the priorities the
kernels received are read afterwards from the timeline (BYTEPS_TRACE_DIR):

* ``fit``: model.fit under BytePSStrategy of a model whose layers are created
  in the reverse of the order they are called (an Embedding first, so the
  sparse path is covered too);
* ``tape``: a DistributedGradientTape loop in a tf.function, variables created
  in reverse and passed to the tape in creation order;
* ``user``: a push_pull of a metric with priority 7 (not a gradient: kept);
* ``plain``: a tf.function without push_pull (result unchanged, pass cost).

Writes OUT_DIR/rank<r>.json: per scenario the tensor names of each variable's
gradient push_pulls and the variables in call order, plus the pass's stats.
"""
import json
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import bps_tf  # noqa: E402
from bps_tf.strategy import BytePSStrategy  # noqa: E402


def pass_stats():
    """The priority pass's own record (see bps_tf/ops/priority_pass_stats.h)."""
    from bps_tf.ops import pass_record
    return pass_record.stats()


class Reversed(keras.Model):
    """Creates its layers last-to-first; calls them first-to-last."""

    def __init__(self):
        super().__init__()
        self.out = keras.layers.Dense(3, name="out")
        self.middle = keras.layers.Dense(6, activation="relu", name="middle")
        self.first = keras.layers.Dense(5, activation="relu", name="first")
        self.embed = keras.layers.Embedding(12, 4, name="embed")

    def call(self, tokens):
        h = keras.ops.mean(self.embed(tokens), axis=1)
        return self.out(self.middle(self.first(h)))


CALL_ORDER = ["embed/embeddings", "first/kernel", "first/bias", "middle/kernel",
              "middle/bias", "out/kernel", "out/bias"]


def fit_scenario(strategy):
    with strategy.scope():
        model = Reversed()
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, 12, size=(32, 3)).astype("int32")
    labels = rng.randint(0, 3, size=(32,))
    model.fit(tokens, labels, batch_size=8, epochs=1, verbose=0, shuffle=False)
    # Which push_pulls serve which variable: the strategy's own record of
    # the gradients the optimizer applied (names only; priorities come from
    # the timeline).
    paths = {id(v.value.values[0]): v.path.split("/", 1)[1] for v in model.trainable_variables}
    tensors = {}
    for graph, applied in strategy.extended._push_pull_ops._applied.items():  # noqa
        for entry in applied:
            for op_name in entry.op_names:
                op = graph.get_operation_by_name(op_name)
                tensors.setdefault(paths[id(entry.variable)], []).append(
                    op.get_attr("tensor_name").decode())
    declared = [v.path.split("/", 1)[1] for v in model.trainable_variables]
    return {"tensors": tensors, "call_order": CALL_ORDER, "declared": declared}


def tape_scenario():
    # Created in reverse of use; the tape gets them in creation order, so the
    # default -index priorities of reduce_gradients are the wrong way round.
    w3 = tf.Variable(tf.random.stateless_normal([6, 2], seed=[1, 3]), name="w3")
    w2 = tf.Variable(tf.random.stateless_normal([5, 6], seed=[1, 2]), name="w2")
    w1 = tf.Variable(tf.random.stateless_normal([4, 5], seed=[1, 1]), name="w1")
    variables = [w3, w2, w1]
    opt = keras.optimizers.SGD(0.1)
    x = tf.random.stateless_normal([8, 4], seed=[2, bps_tf.rank()])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.tanh(tf.tanh(x @ w1) @ w2) @ w3)
        tape = bps_tf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return loss

    for _ in range(3):
        step()
    names = {v.name.split(":")[0]: f"PushPull/DistributedGradientTape/{bps_tf.horovod.api.variable_name(v)}"
             for v in variables}
    return {"tensors": {k: [v] for k, v in names.items()}, "call_order": ["w1", "w2", "w3"]}


def user_scenario():
    @tf.function
    def metric(x):
        return bps_tf.push_pull(tf.reduce_mean(x), name="user_metric", priority=7, op=bps_tf.Sum)

    values = [float(metric(tf.constant([1.0, 2.0]) * (bps_tf.rank() + 1))) for _ in range(2)]
    return {"values": values}


def plain_scenario():
    before = pass_stats()["without_push_pull"]["graphs"]

    @tf.function
    def plain(a):
        return tf.reduce_sum(tf.sin(a) * 2.0 + 1.0)

    a = tf.constant(np.linspace(0, 1, 16).astype("float32"))
    got = float(plain(a))
    want = float(tf.reduce_sum(tf.sin(a) * 2.0 + 1.0))
    after = pass_stats()["without_push_pull"]["graphs"]
    return {"equal": got == want, "graphs_seen": after - before}


def main():
    out_dir = sys.argv[1]
    # The barrier's push_pulls carry the pass's priorities (with overlap, the
    # starts get theirs from the traced step: test_overlap_fit.py).
    strategy = BytePSStrategy(overlap=False)
    report = {"rank": bps_tf.rank(), "size": bps_tf.size()}
    for name, run in [("fit", lambda: fit_scenario(strategy)), ("tape", tape_scenario),
                      ("user", user_scenario), ("plain", plain_scenario)]:
        try:
            report[name] = dict(run(), ok=True)
        except Exception:  # noqa: BLE001 - reported to the test
            report[name] = {"ok": False, "error": traceback.format_exc()}
    report["stats"] = pass_stats()
    with open(os.path.join(out_dir, f"rank{bps_tf.rank()}.json"), "w") as f:
        json.dump(report, f)
    bps_tf.shutdown()


if __name__ == "__main__":
    main()
