"""Priorities from the graph (the C++ priority pass, read back as the kernels
receive them) and bps_tf.compat.tf1_rewriter's push_pull insertion into GraphDefs.

Runs in the test process (one worker, no cluster: push_pull is a copy).
Variables are always created in the reverse of the order the forward pass
reads them, so declaration order and read order disagree.
"""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from bps_tf.runtime import basics  # noqa: E402
from bps_tf.compat import tf1_rewriter


@pytest.fixture(scope="module", autouse=True)
def initialized():
    import bps_tf.ops  # noqa: F401  (registers BytepsPushPull for import_graph_def)
    bps_tf.init()
    assert basics.size() == 1
    yield


def _received():
    """tensor_name -> the priority the push_pull kernel receives (set by the
    C++ priority pass when the graph first runs)."""
    from bps_tf.ops import pass_record
    return pass_record.priorities()


def _push_pull_step(pairs, prefix):
    """In the current tf.function: push_pull each (variable, gradient) and
    apply it (SGD), naming the push_pulls ``<prefix>/<variable name>``."""
    from bps_tf import ops as bps_ops
    for var, grad in pairs:
        name = f"{prefix}/{var.name.split(':')[0]}"
        var.assign_sub(0.01 * bps_ops.push_pull_sum(grad, tensor_name=name, priority=5))


def test_pass_ranks_by_first_read_not_by_creation_in_a_tf_function():
    w3 = tf.Variable(tf.ones([5, 2]), name="w3")
    w2 = tf.Variable(tf.ones([6, 5]), name="w2")
    w1 = tf.Variable(tf.ones([4, 6]), name="w1")
    unused_b = tf.Variable(tf.ones([3]), name="unused_b")
    unused_a = tf.Variable(tf.ones([3]), name="unused_a")

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(tf.matmul(tf.matmul(x, w1), w2), w3))
        grads = tape.gradient(loss, [w3, w2, w1])
        _push_pull_step(zip([w3, w2, w1], grads), "fn")
        # never read: after the read ones, ties broken by name
        _push_pull_step([(unused_b, tf.ones([3])), (unused_a, tf.ones([3]))], "fn")

    step(tf.ones([2, 4]))
    got = _received()
    assert [got[f"fn/{n}"] for n in ("w1", "w2", "w3")] == [0, -1, -2]
    assert [got["fn/unused_a"], got["fn/unused_b"]] == [-3, -4]


def test_pass_sees_reads_in_a_nested_branch():
    # The branch function captures the variables through its parent graph,
    # as a Keras step inside the steps_per_execution while loop does.
    w2 = tf.Variable(tf.ones([3, 2]), name="w2")
    w1 = tf.Variable(tf.ones([2, 3]), name="w1")

    @tf.function
    def outer(x):
        with tf.GradientTape() as tape:
            y = tf.cond(tf.reduce_sum(x) > 0, lambda: tf.matmul(tf.matmul(x, w1), w2),
                        lambda: tf.zeros([1, 2]))
            loss = tf.reduce_sum(y)
        _push_pull_step(zip([w2, w1], tape.gradient(loss, [w2, w1])), "branch")

    outer(tf.ones([1, 2]))
    got = _received()
    assert [got["branch/w1"], got["branch/w2"]] == [0, -1]


def test_pass_orders_a_loop_body_despite_back_edges():
    w2 = tf.Variable(tf.ones([3, 2]), name="w2")
    w1 = tf.Variable(tf.ones([2, 3]), name="w1")

    @tf.function
    def loop(x):
        def body(i):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.matmul(tf.matmul(x, w1), w2))
            _push_pull_step(zip([w2, w1], tape.gradient(loss, [w2, w1])), "loop")
            return (i + 1,)
        return tf.while_loop(lambda i: i < 3, body, (tf.constant(0),))

    loop(tf.ones([1, 2]))
    got = _received()
    assert [got["loop/w1"], got["loop/w2"]] == [0, -1]


def _v1_training_graph(optimizer_fn, use_resource):
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(3)
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        init = tf.compat.v1.initializers.random_normal(seed=1)
        w3 = tf.compat.v1.get_variable("w3", [5, 2], initializer=init, use_resource=use_resource)
        w2 = tf.compat.v1.get_variable("w2", [6, 5], initializer=init, use_resource=use_resource)
        w1 = tf.compat.v1.get_variable("w1", [4, 6], initializer=init, use_resource=use_resource)
        y = tf.matmul(tf.nn.relu(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)), w3)
        loss = tf.reduce_mean(tf.square(y - 1.0))
        train = optimizer_fn().minimize(loss, name="train")
        tf.compat.v1.global_variables_initializer()
    return graph, train.name, loss.name


OPTIMIZERS = [
    ("sgd_ref", lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1), False,
     "ApplyGradientDescent"),
    ("sgd_resource", lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1), True,
     "ResourceApplyGradientDescent"),
    ("adam", lambda: tf.compat.v1.train.AdamOptimizer(0.01), True, "ResourceApplyAdam"),
    ("adam_ref", lambda: tf.compat.v1.train.AdamOptimizer(0.01), False, "ApplyAdam"),
    ("momentum", lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), True,
     "ResourceApplyMomentum"),
]


@pytest.mark.parametrize("name,optimizer_fn,use_resource,apply_type", OPTIMIZERS,
                         ids=[o[0] for o in OPTIMIZERS])
def test_rewrite_inserts_one_push_pull_per_gradient(name, optimizer_fn, use_resource,
                                                    apply_type):
    graph, train, loss = _v1_training_graph(optimizer_fn, use_resource)
    before = graph.as_graph_def()
    after = tf1_rewriter.rewrite_graph_def(before, num_workers=1)
    applies = [n for n in after.node if n.op == apply_type]
    assert len(applies) == 3
    pushes = {n.name: n for n in tf1_rewriter.push_pull_nodes(after)}
    assert len(pushes) == 3
    tensor_names = {}
    for apply in applies:
        grad_index = tf1_rewriter._grad_input_index(apply.op)  # pylint: disable=protected-access
        feeding = apply.input[grad_index]
        assert feeding in pushes, f"{apply.name} is fed by {feeding}"
        node = pushes[feeding]
        tensor_name = node.attr["tensor_name"].s.decode()
        tensor_names[tensor_name.split("/", 1)[1]] = tensor_name
        assert node.attr["T"].type == tf.float32.as_datatype_enum
    # the first layer's weights are read first: highest priority, as the
    # kernels receive it when a session runs the rewritten graph
    _run_steps(after, 1, train, loss)
    got = _received()
    by_variable = {var: got[name] for var, name in tensor_names.items()}
    assert by_variable == {"w1": 0, "w2": -1, "w3": -2}
    assert not tf1_rewriter.push_pull_nodes(before)        # the input is left alone
    again = tf1_rewriter.rewrite_graph_def(after, num_workers=1)
    assert len(tf1_rewriter.push_pull_nodes(again)) == 3   # not rewritten twice


def _run_steps(graph_def, steps, train, loss):
    fresh = tf.Graph()
    with fresh.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
        with tf.compat.v1.Session(graph=fresh) as sess:
            sess.run(fresh.get_operation_by_name("init"))
            x = np.random.RandomState(0).randn(8, 4).astype("float32")
            return [sess.run([train, loss], {"x:0": x})[1] for _ in range(steps)]


def test_rewritten_graph_trains_like_the_original():
    results = []
    for rewrite in (False, True):
        graph, train, loss = _v1_training_graph(
            lambda: tf.compat.v1.train.AdamOptimizer(0.05), True)
        graph_def = graph.as_graph_def()
        if rewrite:
            graph_def = tf1_rewriter.rewrite_graph_def(graph_def, num_workers=1)
        fresh = tf.Graph()
        with fresh.as_default():
            tf.compat.v1.import_graph_def(graph_def, name="")
            init = fresh.get_operation_by_name("init")
            with tf.compat.v1.Session(graph=fresh) as sess:
                sess.run(init)
                x = np.random.RandomState(0).randn(8, 4).astype("float32")
                losses = []
                for _ in range(5):
                    _, value = sess.run([train, loss], {"x:0": x})
                    losses.append(value)
        results.append(losses)
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6)
    assert results[0][-1] < results[0][0]


def test_rewrite_averages_over_workers():
    graph, _, _ = _v1_training_graph(lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                     True)
    after = tf1_rewriter.rewrite_graph_def(graph.as_graph_def(), num_workers=4)
    nodes = {n.name: n for n in after.node}
    for apply in (n for n in after.node if n.op == "ResourceApplyGradientDescent"):
        mean = nodes[apply.input[2]]
        assert mean.op == "Mul"
        assert nodes[mean.input[0]].op == tf1_rewriter.PUSH_PULL_OP
        scale = tf.make_ndarray(nodes[mean.input[1]].attr["value"].tensor)
        assert float(scale) == 0.25


def test_a_priority_fn_choice_is_kept_by_the_pass():
    import bps_tf
    w2 = tf.Variable(tf.ones([3, 2]), name="w2")
    w1 = tf.Variable(tf.ones([2, 3]), name="w1")

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(tf.matmul(x, w1), w2))
        tape = bps_tf.DistributedGradientTape(tape, priority_fn=lambda i, v: 10 + i)
        for var, grad in zip([w2, w1], tape.gradient(loss, [w2, w1])):
            var.assign_sub(0.01 * grad)

    step(tf.ones([1, 2]))
    got = _received()
    # the user's choice (10 + index), not the read order
    assert got["PushPull/DistributedGradientTape/w2"] == 10
    assert got["PushPull/DistributedGradientTape/w1"] == 11
