"""bps_tf: BytePS-style data-parallel training for TensorFlow and Keras.

Gradients are summed through CPU parameter servers: each worker sends its
gradient once and receives the sum once. Horovod scripts switch by changing
one import (`import bps_tf as hvd`).

Importing bps_tf does not import TensorFlow: the TensorFlow-facing names
below load on first use, so servers (`python -m bps_tf.server`) stay light.
"""
from __future__ import annotations

import importlib

from bps_tf.comm.lifecycle import init  # noqa: F401  (no TensorFlow)
from bps_tf.runtime.basics import (cross_rank, cross_size,  # noqa: F401  (no TensorFlow)
                                   get_pushpull_speed, is_homogeneous, is_initialized, local_rank,
                                   local_size, rank, resume, shutdown, size, start_timeline,
                                   stop_timeline, suspend)

__version__ = "0.1.0"

# name -> module that defines it (imported lazily; they need TensorFlow)
_LAZY = {
    "push_pull": "bps_tf.horovod.api",
    "allreduce": "bps_tf.horovod.api",
    "allgather": "bps_tf.horovod.api",
    "grouped_allreduce": "bps_tf.horovod.api",
    "Adasum": "bps_tf.horovod.api",
    "Min": "bps_tf.horovod.api",
    "Max": "bps_tf.horovod.api",
    "Product": "bps_tf.horovod.api",
    "broadcast": "bps_tf.horovod.api",
    "broadcast_variables": "bps_tf.horovod.api",
    "broadcast_object": "bps_tf.horovod.api",
    "broadcast_object_fn": "bps_tf.horovod.api",
    "allgather_object": "bps_tf.horovod.api",
    "DistributedGradientTape": "bps_tf.horovod.tape",
    "PartialDistributedGradientTape": "bps_tf.horovod.tape",
    "Compression": "bps_tf.horovod.api",
    "Average": "bps_tf.horovod.api",
    "Sum": "bps_tf.horovod.api",
    "DistributedOptimizer": "bps_tf.keras",
    "BytePSStrategy": "bps_tf.strategy",
    "gather_predictions": "bps_tf.strategy",
    "grouped_allgather": "bps_tf.horovod.scatter_gather",
    "reducescatter": "bps_tf.horovod.scatter_gather",
    "grouped_reducescatter": "bps_tf.horovod.scatter_gather",
    "alltoall": "bps_tf.horovod.scatter_gather",
    "alltoall_cpu2gpu": "bps_tf.horovod.scatter_gather",
    "alltoall_gpu2cpu": "bps_tf.horovod.scatter_gather",
    "barrier": "bps_tf.horovod.synchronization",
    "broadcast_": "bps_tf.horovod.synchronization",
    "size_op": "bps_tf.horovod.synchronization",
    "rank_op": "bps_tf.horovod.synchronization",
    "local_size_op": "bps_tf.horovod.synchronization",
    "local_rank_op": "bps_tf.horovod.synchronization",
    "process_set_included_op": "bps_tf.horovod.synchronization",
    "join": "bps_tf.horovod.synchronization",
    "SyncBatchNormalization": "bps_tf.horovod.sync_batch_norm",
    "broadcast_global_variables": "bps_tf.compat.tf1_session",
    "_executing_eagerly": "bps_tf.util",
    "BroadcastGlobalVariablesHook": "bps_tf.compat.tf1_session",
    **{query: "bps_tf.horovod.build_info" for query in (
        "mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
        "rocm_built", "sycl_built", "mpi_enabled", "gloo_enabled", "mpi_threads_supported")},
    **{name: "bps_tf.runtime.process_sets" for name in (
        "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
        "process_set_by_id")},
}


# The documented API: `from bps_tf import *` gives all of it (the lazy names
# import TensorFlow then; a plain `import bps_tf` still does not).
__all__ = ["init", "shutdown", "is_initialized", "size", "rank", "local_size",
           "local_rank", "cross_size", "cross_rank", "is_homogeneous", "start_timeline",
           "stop_timeline", "suspend", "resume", "get_pushpull_speed",
           *(n for n in _LAZY if not n.startswith("_"))]


def __getattr__(name):
    # hvd.util, hvd.elastic, hvd.mpi_ops as in Horovod; bps.distribute as in BytePS
    if name in ("util", "elastic", "mpi_ops", "distribute", "overlap"):
        return importlib.import_module(f"bps_tf.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bps_tf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
