"""bps_tf.graph_priorities (topological priorities) and bps_tf.tf1_rewriter
(push_pull insertion into GraphDefs).

Runs in the test process (one worker, no cluster: push_pull is a copy).
Variables are always created in the reverse of the order the forward pass
reads them, so declaration order and read order disagree.
"""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from bps_tf import basics, graph_priorities, tf1_rewriter  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def initialized():
    import bps_tf.ops  # noqa: F401  (registers BytepsPushPull for import_graph_def)
    basics.init()
    assert basics.size() == 1
    yield


def test_topological_order_respects_edges_and_keeps_ready_order():
    # d depends on c which is listed after it; a and b are independent.
    nodes = [("a", []), ("d", ["c"]), ("b", []), ("c", ["a"])]
    order = graph_priorities.topological_order(nodes)
    assert order["c"] < order["d"] and order["a"] < order["c"]
    assert sorted(order.values()) == [0, 1, 2, 3]
    assert order["a"] == 0 and order["b"] == 1      # ties: the list's order


def test_loop_back_edges_do_not_stall_the_order():
    nodes = [("enter", []), ("merge", ["enter", "next"]), ("body", ["merge"]),
             ("next", ["body"])]
    order = graph_priorities.topological_order(nodes, {"next": "NextIteration"})
    assert order["enter"] < order["merge"] < order["body"] < order["next"]


def test_rank_priorities_breaks_ties_by_name_and_puts_unread_last():
    ranks = graph_priorities.rank_priorities(["c", "a", "b", "z"], {"c": 5, "a": 9, "b": 5})
    assert ranks == {"b": 0, "c": -1, "a": -2, "z": -3}


def test_variable_priorities_in_a_tf_function():
    w3 = tf.Variable(tf.ones([5, 2]), name="w3")
    w2 = tf.Variable(tf.ones([6, 5]), name="w2")
    w1 = tf.Variable(tf.ones([4, 6]), name="w1")

    @tf.function
    def forward(x):
        return tf.matmul(tf.matmul(tf.matmul(x, w1), w2), w3)

    graph = forward.get_concrete_function(tf.TensorSpec([None, 4])).graph
    assert graph_priorities.variable_priorities(graph, [w3, w2, w1]) == [-2, -1, 0]
    unused = tf.Variable(1.0, name="unused")
    assert graph_priorities.variable_priorities(graph, [unused, w1]) == [-1, 0]


def test_variable_priorities_in_a_nested_branch():
    # A branch function captures the variables through its parent graph,
    # as a Keras step inside the steps_per_execution while loop does.
    w2 = tf.Variable(tf.ones([3, 2]), name="w2")
    w1 = tf.Variable(tf.ones([2, 3]), name="w1")
    seen = {}

    @tf.function
    def outer(x):
        def branch():
            seen["graph"] = tf.compat.v1.get_default_graph()
            return tf.matmul(tf.matmul(x, w1), w2)
        return tf.cond(tf.reduce_sum(x) > 0, branch, lambda: tf.zeros([1, 2]))

    outer.get_concrete_function(tf.TensorSpec([1, 2]))
    assert seen["graph"].outer_graph is not None
    assert graph_priorities.variable_priorities(seen["graph"], [w2, w1]) == [-1, 0]


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
    graph, _, _ = _v1_training_graph(optimizer_fn, use_resource)
    before = graph.as_graph_def()
    after = tf1_rewriter.rewrite_graph_def(before, num_workers=1)
    applies = [n for n in after.node if n.op == apply_type]
    assert len(applies) == 3
    pushes = {n.name: n for n in tf1_rewriter.push_pull_nodes(after)}
    assert len(pushes) == 3
    by_variable = {}
    for apply in applies:
        grad_index = tf1_rewriter._grad_input_index(apply.op)  # pylint: disable=protected-access
        feeding = apply.input[grad_index]
        assert feeding in pushes, f"{apply.name} is fed by {feeding}"
        node = pushes[feeding]
        var = node.attr["tensor_name"].s.decode().split("/", 1)[1]
        by_variable[var] = node.attr["priority"].i
        assert node.attr["T"].type == tf.float32.as_datatype_enum
    # the first layer's weights are read first: highest priority
    assert by_variable == {"w1": 0, "w2": -1, "w3": -2}
    assert not tf1_rewriter.push_pull_nodes(before)        # the input is left alone
    again = tf1_rewriter.rewrite_graph_def(after, num_workers=1)
    assert len(tf1_rewriter.push_pull_nodes(again)) == 3   # not rewritten twice


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
