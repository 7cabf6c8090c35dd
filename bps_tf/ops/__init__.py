"""TensorFlow ops of bps_tf: loading and Python wrappers (their gradients:
bps_tf.comm.gradients, registered when bps_tf.comm.collectives loads the ops).

`push_pull_sum` sums a tensor across workers; `broadcast_raw` returns the
root's value. Both run as asynchronous kernels on the core's engine.
"""
from __future__ import annotations

import os

import tensorflow as tf

from bps_tf.runtime import basics, hooks, op_build
from bps_tf.runtime.loader import preload_libzmq

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
@hooks.register("tf auto_control_deps.ASYNC_STATEFUL_OPS", "ops",
                hooks.module_attribute("tensorflow.python.framework.auto_control_deps",
                                       "ASYNC_STATEFUL_OPS"),
                changes="the push_pull ops are listed among the asynchronous stateful ops",
                why="tf.function chains stateful ops in program order; TensorFlow lists its "
                    "own collectives here and has no public registry",
                when_missing="fallback", private=True)
def _async_stateful(original):
    return frozenset(set(original) | set(OP_TYPES))


if hooks.install("ops"):
    hooks.warn_fallback("ops", "the push_pulls of one traced step run one after another "
                               "(exact, slower)")


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


def membership(query: str):
    """This worker's `query` ('rank', 'size', 'local_rank', 'local_size',
    'cross_rank', 'cross_size') as an int32 scalar read when the op runs."""
    return _ops.byteps_membership(query=query)


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


tf.no_gradient("BytepsMembership")
tf.no_gradient("BytepsPushPullStart")
tf.no_gradient("BytepsPushPullWait")
