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


def mpi_built(verbose=False):
    """False: bps_tf does not use MPI."""
    del verbose
    return False


def gloo_built(verbose=False):
    """False: bps_tf does not use Gloo."""
    del verbose
    return False


def nccl_built(verbose=False):
    """False: GPU tensors are reduced by the parameter servers, not NCCL."""
    del verbose
    return False


def ddl_built(verbose=False):
    """False: no IBM DDL."""
    del verbose
    return False


def ccl_built(verbose=False):
    """False: no oneCCL."""
    del verbose
    return False


def rocm_built(verbose=False):
    """False: no ROCm kernels."""
    del verbose
    return False


def sycl_built(verbose=False):
    """False: no SYCL (Intel GPU) kernels."""
    del verbose
    return False


def cuda_built(verbose=False):
    """True if the loaded op library registers a GPU kernel for push_pull."""
    del verbose
    from bps_tf.comm import collectives  # imports TensorFlow: only when asked
    return "GPU" in collectives.kernel_devices()


def mpi_enabled():
    """False: jobs never run on MPI."""
    return False


def gloo_enabled():
    """False: jobs never run on Gloo."""
    return False


def mpi_threads_supported():
    """False: there is no MPI to share with mpi4py."""
    return False
