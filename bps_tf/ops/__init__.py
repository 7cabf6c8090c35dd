"""TensorFlow ops of bps_tf: loading, Python wrappers and gradients.

`push_pull_sum` sums a tensor across workers; `broadcast_raw` returns the
root's value. Both run as asynchronous kernels on the core's engine.
"""
from __future__ import annotations

import os

import tensorflow as tf
from tensorflow.python.framework import auto_control_deps

from bps_tf import basics, naming, op_build
from bps_tf._loader import preload_libzmq

OP_TYPES = ("BytepsPushPull", "BytepsBroadcast", "BytepsPushPullStart", "BytepsPushPullWait")


def _load():
    preload_libzmq()
    core = basics.core()  # loads libbps_core.so once, shared with the op library
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = op_build.ensure_op_library(
        package_dir, core_lib_dir=os.path.dirname(os.path.abspath(core.__file__)))
    return path, tf.load_op_library(path)


# The op library in use: the installed one or a build in the cache (op_build).
LIBRARY_PATH, _ops = _load()

# Stateful ops are chained in program order by tf.function's automatic
# control dependencies, which would serialise every push_pull of a step.
# Listing them as asynchronous stateful ops (as TensorFlow does for its own
# collectives) lets them overlap while keeping Grappler away from them.
auto_control_deps.ASYNC_STATEFUL_OPS = frozenset(
    set(auto_control_deps.ASYNC_STATEFUL_OPS) | set(OP_TYPES))


def push_pull_sum(tensor, tensor_name: str, priority: int = 0, compression: str = "",
                  agreement: str = ""):
    """Sum of `tensor` over all workers (a copy when there is one);
    `compression`: the core's compressor text for float32 tensors;
    `agreement`: what every worker must pass alike ("set=0,2": a process set)."""
    return _ops.byteps_push_pull(tensor, tensor_name=tensor_name, priority=int(priority),
                                 compression=compression, agreement=agreement)


def push_pull_reduce(tensor, tensor_name: str, reduce_op: str, priority: int = 0,
                     agreement: str = ""):
    """Min, max or product (`reduce_op`) of `tensor` over all workers (of the
    process set `agreement` names, if any), computed by the servers in the
    tensor's dtype (a copy when there is one worker)."""
    return _ops.byteps_push_pull(tensor, tensor_name=tensor_name, priority=int(priority),
                                 reduce_op=reduce_op, agreement=agreement)


def broadcast_raw(tensor, tensor_name: str, root_rank: int, priority: int = 0,
                  agreement: str = ""):
    """root_rank's value of `tensor`, on every worker (of the process set
    `agreement` names, if any)."""
    return _ops.byteps_broadcast(tensor, tensor_name=tensor_name, root_rank=int(root_rank),
                                 priority=int(priority), agreement=agreement)


def push_pull_start(tensor, tensor_name: str, priority: int = 0):
    """Starts the sum of `tensor` under `tensor_name`; returns a token at once."""
    return _ops.byteps_push_pull_start(tensor, tensor_name=tensor_name, priority=int(priority))


def push_pull_wait(like, tensor_name: str):
    """(sum, valid) of the sum started under `tensor_name` (see overlap_ops.cc)."""
    return _ops.byteps_push_pull_wait(like, tensor_name=tensor_name)


def push_pull_pending_keys():
    """Names started and not yet waited for in this process."""
    return _ops.byteps_push_pull_pending_keys()


def push_pull_debug_hold(x, command: str, tensor_name: str = "", timeout_ms: int = 10000):
    """Diagnostics (see overlap_ops.cc): returns (x, log of holds)."""
    return _ops.byteps_push_pull_debug_hold(x, command=command, tensor_name=tensor_name,
                                           timeout_ms=int(timeout_ms))


tf.no_gradient("BytepsPushPullStart")
tf.no_gradient("BytepsPushPullWait")


@tf.RegisterGradient("BytepsPushPullDebugHold")
def _debug_hold_grad(op, grad, _log_grad):
    return [grad]   # y is x


@tf.RegisterGradient("BytepsPushPull")
def _push_pull_grad(op, grad):
    # The output is the sum of every worker's input, so each input's
    # gradient is the sum of every worker's output gradient.
    name = naming.gradient_key(op.get_attr("tensor_name").decode())
    agreement = op.get_attr("agreement").decode()
    summed = push_pull_sum(grad, name, op.get_attr("priority"), agreement=agreement)
    try:
        kind = op.get_attr("reduce_op").decode()
    except ValueError:  # a node built without the attr (e.g. an older graph): a sum
        kind = "sum"
    if kind == "sum":
        return [summed]
    return [_reduce_op_grad(op, kind, summed, name, agreement)]


def _set_rank_size(agreement):
    """This worker's rank and the size of the process set an agreement names
    ("set=0,2"), or of every worker when it names none."""
    rank, size = (basics.rank(), basics.size()) if basics.is_initialized() else (0, 1)
    for term in agreement.split():
        if term.startswith("set="):
            members = [int(r) for r in term[4:].split(",")]
            return members.index(rank), len(members)
    return rank, size


def _reduce_op_grad(op, kind, summed, name, agreement):
    """The gradient of min/max/product through one worker's input, as the
    gradient of TensorFlow's reduce_min/max/prod over the stack of every
    worker's input: a min/max's gradient is shared among the workers that
    hold the extreme value, a product's is the product of the others."""
    x, y = op.inputs[0], op.outputs[0]
    priority = op.get_attr("priority")
    if kind in ("min", "max"):
        held = tf.cast(tf.equal(x, y), summed.dtype)
        holders = push_pull_sum(held, naming.part_key(name, "holders"), priority,
                                agreement=agreement)
        return summed * held / holders
    rank, size = _set_rank_size(agreement)
    # Every worker's input, gathered exactly (x + 0 == x), in rank order.
    rows = tf.scatter_nd([[rank]], tf.expand_dims(x, 0),
                         tf.concat([[size], tf.shape(x)], 0))
    every = push_pull_sum(rows, naming.part_key(name, "factors"), priority, agreement=agreement)
    others = tf.tensor_scatter_nd_update(every, [[rank]], tf.expand_dims(tf.ones_like(x), 0))
    return summed * tf.reduce_prod(others, axis=0)


@tf.RegisterGradient("BytepsBroadcast")
def _broadcast_grad(op, grad):
    # Only the root's input reaches the output: it receives the summed
    # gradient, the others none.
    name = naming.gradient_key(op.get_attr("tensor_name").decode())
    summed = push_pull_sum(grad, name, op.get_attr("priority"),
                           agreement=op.get_attr("agreement").decode())
    if basics.is_initialized() and basics.rank() != op.get_attr("root_rank"):
        # The zeros must still wait for the push_pull: the root waits for
        # this worker's share, and in a TF1 session (or after Grappler folds
        # zeros of a known shape) nothing else would make it run.
        with tf.control_dependencies([summed]):
            return [tf.zeros_like(grad)]
    return [summed]
