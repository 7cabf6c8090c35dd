"""bps_tf: BytePS-style data-parallel training for TensorFlow and Keras.

Gradients are summed through CPU parameter servers: each worker sends its
gradient once and receives the sum once. Horovod scripts switch by changing
one import (`import bps_tf as hvd`).

Importing bps_tf does not import TensorFlow: the TensorFlow-facing names
below load on first use, so servers (`python -m bps_tf.server`) stay light.
"""
from __future__ import annotations

import importlib

from bps_tf.basics import (  # noqa: F401  (no TensorFlow)
    cross_rank,
    cross_size,
    get_pushpull_speed,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    rank,
    resume,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    suspend,
)

__version__ = "0.1.0"

# name -> module that defines it (imported lazily; they need TensorFlow)
_LAZY = {
    "push_pull": "bps_tf.api",
    "allreduce": "bps_tf.api",
    "allgather": "bps_tf.api",
    "grouped_allreduce": "bps_tf.api",
    "Adasum": "bps_tf.api",
    "Min": "bps_tf.api",
    "Max": "bps_tf.api",
    "Product": "bps_tf.api",
    "broadcast": "bps_tf.api",
    "broadcast_variables": "bps_tf.api",
    "broadcast_object": "bps_tf.api",
    "broadcast_object_fn": "bps_tf.api",
    "allgather_object": "bps_tf.api",
    "DistributedGradientTape": "bps_tf.tape",
    "PartialDistributedGradientTape": "bps_tf.tape",
    "Compression": "bps_tf.api",
    "Average": "bps_tf.api",
    "Sum": "bps_tf.api",
    "DistributedOptimizer": "bps_tf.keras",
    "BytePSStrategy": "bps_tf.strategy",
    "gather_predictions": "bps_tf.strategy",
    "grouped_allgather": "bps_tf.scatter_gather",
    "reducescatter": "bps_tf.scatter_gather",
    "grouped_reducescatter": "bps_tf.scatter_gather",
    "alltoall": "bps_tf.scatter_gather",
    "alltoall_cpu2gpu": "bps_tf.scatter_gather",
    "alltoall_gpu2cpu": "bps_tf.scatter_gather",
    "barrier": "bps_tf.synchronization",
    "broadcast_": "bps_tf.synchronization",
    "size_op": "bps_tf.synchronization",
    "rank_op": "bps_tf.synchronization",
    "local_size_op": "bps_tf.synchronization",
    "local_rank_op": "bps_tf.synchronization",
    "process_set_included_op": "bps_tf.synchronization",
    "join": "bps_tf.synchronization",
    "SyncBatchNormalization": "bps_tf.sync_batch_norm",
    "broadcast_global_variables": "bps_tf.tf1_session",
    "_executing_eagerly": "bps_tf.util",
    "BroadcastGlobalVariablesHook": "bps_tf.tf1_session",
    **{query: "bps_tf.build_info" for query in (
        "mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
        "rocm_built", "sycl_built", "mpi_enabled", "gloo_enabled", "mpi_threads_supported")},
    **{name: "bps_tf.process_sets" for name in (
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
    if name in ("util", "elastic", "mpi_ops", "distribute"):
        return importlib.import_module(f"bps_tf.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bps_tf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
