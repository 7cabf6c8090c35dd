"""Horovod's build queries, answered for bps_tf.

bps_tf has no MPI, Gloo, NCCL, DDL, oneCCL, ROCm or SYCL: workers talk to
parameter servers over ZeroMQ. ``cuda_built()`` says whether the loaded op
library has a GPU kernel for the push_pull op (it loads the op library to
find out); everything else is a constant. Importing this module does not
import TensorFlow.
"""
from __future__ import annotations

__all__ = ["mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
           "rocm_built", "sycl_built", "mpi_enabled", "gloo_enabled", "mpi_threads_supported"]


def _false(name: str, why: str, takes_verbose: bool = True):
    """A Horovod build query that answers False for bps_tf, and says why."""
    if takes_verbose:
        def query(verbose=False):
            del verbose
            return False
    else:
        def query():
            return False
    query.__name__ = query.__qualname__ = name
    query.__doc__ = f"False: {why}"
    return query


mpi_built = _false("mpi_built", "bps_tf does not use MPI.")
gloo_built = _false("gloo_built", "bps_tf does not use Gloo.")
nccl_built = _false("nccl_built", "GPU tensors are reduced by the parameter servers, not NCCL.")
ddl_built = _false("ddl_built", "no IBM DDL.")
ccl_built = _false("ccl_built", "no oneCCL.")
rocm_built = _false("rocm_built", "no ROCm kernels.")
sycl_built = _false("sycl_built", "no SYCL (Intel GPU) kernels.")
mpi_enabled = _false("mpi_enabled", "jobs never run on MPI.", takes_verbose=False)
gloo_enabled = _false("gloo_enabled", "jobs never run on Gloo.", takes_verbose=False)
mpi_threads_supported = _false("mpi_threads_supported",
                               "there is no MPI to share with mpi4py.", takes_verbose=False)


def cuda_built(verbose=False):
    """True if the loaded op library registers a GPU kernel for push_pull."""
    del verbose
    from bps_tf.comm import collectives  # imports TensorFlow: only when asked
    return "GPU" in collectives.kernel_devices()
