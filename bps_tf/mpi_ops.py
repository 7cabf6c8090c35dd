"""Horovod's ``horovod.tensorflow.mpi_ops``, for code that reaches into it.

Horovod scripts and tests sometimes call ``hvd.mpi_ops.<name>`` or the
module's ``_basics`` object (``_basics._get_process_set_ids_and_ranks()``)
instead of the package's names. Here the same names lead to bps_tf's
functions; there is no MPI behind them, the module's name is Horovod's.
"""
from __future__ import annotations

from bps_tf.horovod.api import Adasum, Average, Max, Min, Product, Sum, allgather, broadcast
from bps_tf.horovod.build_info import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled,
                                       mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
                                       rocm_built, sycl_built)
from bps_tf.comm.lifecycle import init  # noqa: F401
from bps_tf.horovod.scatter_gather import alltoall, reducescatter
from bps_tf.horovod.synchronization import (barrier, join, local_rank_op, local_size_op,
                                            process_set_included_op, rank_op, size_op)
from bps_tf.runtime import basics, process_sets
from bps_tf.runtime.basics import (cross_rank, cross_size, is_homogeneous, is_initialized,
                                   local_rank, local_size, rank, shutdown, size, start_timeline,
                                   stop_timeline)

__all__ = ["Adasum", "Average", "Max", "Min", "Product", "Sum", "allgather", "alltoall",
           "barrier", "broadcast", "ccl_built", "cross_rank", "cross_size", "cuda_built",
           "ddl_built", "gloo_built", "gloo_enabled", "init", "is_homogeneous",
           "is_initialized", "join", "local_rank", "local_rank_op", "local_size",
           "local_size_op", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
           "process_set_included_op", "rank", "rank_op", "reducescatter", "rocm_built",
           "shutdown", "size", "size_op", "start_timeline", "stop_timeline", "sycl_built"]


class _Basics:
    """The part of Horovod's ``HorovodBasics`` that code calls directly; any
    other attribute is bps_tf.runtime.basics' (``init``, ``size``, ``rank``, ...)."""

    @staticmethod
    def _get_process_set_ids_and_ranks():
        """{process_set_id: ranks} of every registered set, the global one included."""
        return process_sets.ids_and_ranks()

    def __getattr__(self, name):
        return getattr(basics, name)


_basics = _Basics()
