"""Worker script for test_tf1_optimizer.py (run under bpslaunch, 2 workers).

    bpslaunch -np 2 --servers 1 python tests/workers/tf1_checks.py OUT_DIR

A tf.compat.v1 MLP with an embedding lookup (a sparse gradient) trained 20
steps in a Session on this worker's half of each global batch, then the same
graph trained by this process alone on the whole global batches (the
reference):

* ``wrap``: bps_tf.DistributedOptimizer(<TF1 optimizer>);
* ``rewrite``: the same graph with a plain optimizer and
  bps_tf.compat.v1.enable_graph_rewrite();
* ``sparse_refused``: a sparse update the rewrite cannot trace to
  tf.gradients' output fails, naming the op.

Writes OUT_DIR/<mode>_<case>.rank<r>.npz with both sets of final weights.
"""
import json
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import bps_tf  # noqa: E402

STEPS, GLOBAL_BATCH, VOCAB, TOKENS = 20, 16, 30, 3
CASES = {
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.01),
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(0.05, 0.9),
}


def data():
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, VOCAB, size=(STEPS, GLOBAL_BATCH, TOKENS)).astype("int32")
    labels = rng.randint(0, 3, size=(STEPS, GLOBAL_BATCH)).astype("int32")
    return tokens, labels


def train(case, distributed, rows, use_resource=True):
    graph = tf.Graph()
    with graph.as_default():
        tokens = tf.compat.v1.placeholder(tf.int32, [None, TOKENS], name="tokens")
        labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        init = tf.compat.v1.initializers.random_normal(stddev=0.3, seed=1)
        # created in the reverse of the order they are used
        w2 = tf.compat.v1.get_variable("w2", [8, 3], initializer=init, use_resource=use_resource)
        w1 = tf.compat.v1.get_variable("w1", [4, 8], initializer=init, use_resource=use_resource)
        table = tf.compat.v1.get_variable("table", [VOCAB, 4], initializer=init,
                                          use_resource=use_resource)
        h = tf.reduce_mean(tf.nn.embedding_lookup(table, tokens), axis=1)
        logits = tf.matmul(tf.nn.relu(tf.matmul(h, w1)), w2)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))
        opt = CASES[case]()
        if distributed == "wrap":
            opt = bps_tf.DistributedOptimizer(opt)
        train_op = opt.minimize(loss)
        init_op = tf.compat.v1.global_variables_initializer()
        x, y = data()
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(init_op)
            for step in range(STEPS):
                sess.run(train_op, {tokens: x[step, rows], labels: y[step, rows]})
            return {v.op.name: sess.run(v) for v in (table, w1, w2)}


def untraceable_sparse_update(rows):
    graph = tf.Graph()
    with graph.as_default():
        tokens = tf.compat.v1.placeholder(tf.int32, [None, TOKENS], name="tokens")
        table = tf.compat.v1.get_variable("table", [VOCAB, 4], use_resource=True)
        loss = tf.reduce_sum(tf.nn.embedding_lookup(table, tokens))
        grad = tf.gradients(loss, table)[0]
        update = tf.compat.v1.scatter_add(table, grad.indices, -0.1 * tf.nn.softsign(grad.values))
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(update, {tokens: data()[0][0, rows]})


class FedGradients(tf.compat.v1.train.GradientDescentOptimizer):
    """Learning rate 1; its gradients are fed (dense for ``w``, one row of
    ``table`` as IndexedSlices), so the expected weights are plain sums."""

    def __init__(self, dense, row):
        super().__init__(1.0)
        self.fed = (dense, row)

    def compute_gradients(self, loss, var_list=None, **kwargs):
        dense, row = self.fed
        w, table = var_list
        rows = tf.IndexedSlices(tf.reshape(row, [1, 1]), tf.constant([1]), tf.constant([2, 1]))
        return [(dense, w), (rows, table)]


def aggregation(rank, passes, average, predivide=1.0, sparse_as_dense=False, runs=7):
    """Weights and global_step after each run, with gradients
    (rank + 1) * (run + 1) fed in; see test_tf1_optimizer.py."""
    with tf.Graph().as_default():
        dense = tf.compat.v1.placeholder(tf.float32, [1])
        row = tf.compat.v1.placeholder(tf.float32, [])
        w = tf.compat.v1.get_variable("w", initializer=[0.0], use_resource=True)
        table = tf.compat.v1.get_variable("table", initializer=[[0.0], [0.0]],
                                          use_resource=True)
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = bps_tf.DistributedOptimizer(
            FedGradients(dense, row), backward_passes_per_step=passes,
            average_aggregated_gradients=average, gradient_predivide_factor=predivide,
            sparse_as_dense=sparse_as_dense)
        pairs = opt.compute_gradients(None, var_list=[w, table])
        train = opt.apply_gradients(pairs, global_step=step)
        seen = []
        with tf.compat.v1.Session() as sess:
            sess.run([tf.compat.v1.global_variables_initializer(),
                      tf.compat.v1.local_variables_initializer()])
            for run in range(runs):
                g = float((rank + 1) * (run + 1))
                sess.run(train, {dense: [g], row: 2 * g})
                seen.append([float(sess.run(w)[0]), float(sess.run(table)[1, 0]),
                             int(sess.run(step))])
    return seen


def broadcast_globals(rank):
    got = {}
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.fill([3], float(rank + 1)))
        step = tf.compat.v1.train.get_or_create_global_step()
        hook = bps_tf.BroadcastGlobalVariablesHook(1)
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=[hook]) as sess:
            got["hook_w"] = sess.run(w).tolist()
            got["hook_step"] = int(sess.run(step))
    with tf.Graph().as_default():
        v = tf.Variable([float(10 * (rank + 1))], name="v")
        op = bps_tf.broadcast_global_variables(0)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(op)
            got["op_v"] = sess.run(v).tolist()
    return got


def main():
    out_dir = sys.argv[1]
    tf.compat.v1.disable_eager_execution()
    bps_tf.init()
    rank, size = bps_tf.rank(), bps_tf.size()
    half = GLOBAL_BATCH // size
    mine = slice(rank * half, (rank + 1) * half)
    from bps_tf.compat import v1 as bps_v1
    for mode in ("wrap", "rewrite"):
        for case in CASES:
            for use_resource in (True, False):
                name = f"{mode}_{case}_{'resource' if use_resource else 'ref'}"
                try:
                    if mode == "rewrite":
                        bps_v1.enable_graph_rewrite()
                    got = train(case, mode, mine, use_resource)
                    bps_v1.disable_graph_rewrite()
                    ref = train(case, None, slice(0, GLOBAL_BATCH), use_resource)
                    np.savez(os.path.join(out_dir, f"{name}.rank{rank}.npz"),
                             **{f"got_{k}": v for k, v in got.items()},
                             **{f"ref_{k}": v for k, v in ref.items()})
                except Exception:  # noqa: BLE001 - reported to the test
                    bps_v1.disable_graph_rewrite()
                    with open(os.path.join(out_dir, f"{name}.rank{rank}.error"), "w") as f:
                        f.write(traceback.format_exc())
    # Gradients of every collective in a TF1 session (they once hung here).
    try:
        import json
        import gradient_checks
        result = json.dumps(gradient_checks.run("tf1", rank, size))
    except Exception:  # noqa: BLE001 - reported to the test
        result = "error: " + traceback.format_exc()
    with open(os.path.join(out_dir, f"gradients.rank{rank}.txt"), "w") as f:
        f.write(result)
    # backward_passes_per_step and gradient_predivide_factor with a TF1 optimizer.
    try:
        result = json.dumps({
            "passes3_sum": aggregation(rank, 3, False),
            "passes3_average_dense_rows": aggregation(rank, 3, True, sparse_as_dense=True),
            "predivide2": aggregation(rank, 1, False, predivide=2.0, runs=2)})
    except Exception:  # noqa: BLE001 - reported to the test
        result = "error: " + traceback.format_exc()
    with open(os.path.join(out_dir, f"aggregation.rank{rank}.txt"), "w") as f:
        f.write(result)
    # Every global variable from the root: the hook in a MonitoredTrainingSession
    # and the op in a plain session (each rank starts from its own values).
    try:
        result = json.dumps(broadcast_globals(rank))
    except Exception:  # noqa: BLE001 - reported to the test
        result = "error: " + traceback.format_exc()
    with open(os.path.join(out_dir, f"broadcast_globals.rank{rank}.txt"), "w") as f:
        f.write(result)
    # A sparse update the rewrite cannot trace to tf.gradients' IndexedSlices
    # (a Softsign of the values): refused, naming the op.
    bps_v1.enable_graph_rewrite()
    try:
        untraceable_sparse_update(mine)
        message = "no error"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        message = str(exc)
    bps_v1.disable_graph_rewrite()
    with open(os.path.join(out_dir, f"sparse_refused.rank{rank}.txt"), "w") as f:
        f.write(message)
    bps_tf.shutdown()


if __name__ == "__main__":
    main()
