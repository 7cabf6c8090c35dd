"""Gradients of the push_pull and broadcast ops.

The output of a push_pull is the sum of every worker's input, so each
input's gradient is the sum of every worker's output gradient: one more
push_pull, under a key derived from the forward one (bps_tf.comm.naming).
Registered when bps_tf.comm.collectives first loads the op library.
"""
from __future__ import annotations

import tensorflow as tf

from bps_tf import ops
from bps_tf.comm import naming
from bps_tf.runtime import basics


def _now(query: str):
    """This worker's ``query`` ('rank', 'size'): an int eagerly, read when
    the graph runs otherwise (as bps_tf.comm.membership, which builds on
    the collectives that load this module)."""
    if tf.executing_eagerly():
        return int(getattr(basics, query)())
    return ops.membership(query)


@tf.RegisterGradient("BytepsPushPullDebugHold")
def _debug_hold_grad(op, grad, _log_grad):
    return [grad]   # y is x


@tf.RegisterGradient("BytepsPushPull")
def _push_pull_grad(op, grad):
    # The output is the sum of every worker's input, so each input's
    # gradient is the sum of every worker's output gradient.
    name = naming.gradient_key(op.get_attr("tensor_name").decode())
    agreement = op.get_attr("agreement").decode()
    summed = ops.push_pull_sum(grad, name, op.get_attr("priority"), agreement=agreement)
    try:
        kind = op.get_attr("reduce_op").decode()
    except ValueError:  # a node built without the attr (e.g. an older graph): a sum
        kind = "sum"
    if kind == "sum":
        return [summed]
    return [_reduce_op_grad(op, kind, summed, name, agreement)]


def _set_rank_size(agreement):
    """This worker's rank and the size of the process set an agreement names
    ("set=0,2", fixed ranks), or of every worker when it names none (read
    when the graph runs)."""
    for term in agreement.split():
        if term.startswith("set="):
            members = [int(r) for r in term[4:].split(",")]
            return members.index(basics.rank()), len(members)
    if not basics.is_initialized():
        return 0, 1
    return _now("rank"), _now("size")


def _reduce_op_grad(op, kind, summed, name, agreement):
    """The gradient of min/max/product through one worker's input, as the
    gradient of TensorFlow's reduce_min/max/prod over the stack of every
    worker's input: a min/max's gradient is shared among the workers that
    hold the extreme value, a product's is the product of the others."""
    x, y = op.inputs[0], op.outputs[0]
    priority = op.get_attr("priority")
    if kind in ("min", "max"):
        held = tf.cast(tf.equal(x, y), summed.dtype)
        holders = ops.push_pull_sum(held, naming.part_key(name, "holders"), priority,
                                agreement=agreement)
        return summed * held / holders
    rank, size = _set_rank_size(agreement)
    # Every worker's input, gathered exactly (x + 0 == x), in rank order.
    rows = tf.scatter_nd([[rank]], tf.expand_dims(x, 0),
                         tf.concat([[size], tf.shape(x)], 0))
    every = ops.push_pull_sum(rows, naming.part_key(name, "factors"), priority, agreement=agreement)
    others = tf.tensor_scatter_nd_update(every, [[rank]], tf.expand_dims(tf.ones_like(x), 0))
    return summed * tf.reduce_prod(others, axis=0)


@tf.RegisterGradient("BytepsBroadcast")
def _broadcast_grad(op, grad):
    # Only the root's input reaches the output: it receives the summed
    # gradient, the others none.
    name = naming.gradient_key(op.get_attr("tensor_name").decode())
    summed = ops.push_pull_sum(grad, name, op.get_attr("priority"),
                           agreement=op.get_attr("agreement").decode())
    if not basics.is_initialized():
        return [summed]
    rank, root_rank = _now("rank"), op.get_attr("root_rank")
    root = rank == root_rank if isinstance(rank, int) else tf.equal(rank, root_rank)
    if isinstance(root, bool):
        if root:
            return [summed]
        # The zeros must still wait for the push_pull: the root waits for
        # this worker's share, and in a TF1 session (or after Grappler folds
        # zeros of a known shape) nothing else would make it run.
        with tf.control_dependencies([summed]):
            return [tf.zeros_like(grad)]
    # In a graph: whether this worker is the root is read when it runs.
    return [tf.where(root, summed, tf.zeros_like(summed))]
