"""Keras 3 face of bps_tf, shaped like ``horovod.tensorflow.keras``:

    import bps_tf.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()))
    model.compile(optimizer=opt, loss=...)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])
"""
from __future__ import annotations

from bps_tf.comm.naming import model_variables
from bps_tf.keras import elastic  # noqa: F401  (hvd.elastic: state objects, run, Keras callbacks)
from bps_tf.horovod.api import Average, Compression, Sum, allgather, allgather_object
from bps_tf.horovod.api import allreduce as _tensor_allreduce
from bps_tf.horovod.api import broadcast, broadcast_object, broadcast_variables, push_pull
from bps_tf.horovod.build_info import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled,
                                       mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
                                       rocm_built)
from bps_tf.comm.lifecycle import init  # noqa: F401
from bps_tf.horovod.scatter_gather import reducescatter as _tensor_reducescatter
from bps_tf.horovod.sync_batch_norm import SyncBatchNormalization
from bps_tf.keras import callbacks
from bps_tf.keras.optimizer import (DistributedOptimizer, PartialDistributedOptimizer,
                                    make_distributed_in_place)
from bps_tf.runtime.basics import (cross_rank, cross_size, is_homogeneous, is_initialized,
                                   local_rank, local_size, rank, shutdown, size, start_timeline,
                                   stop_timeline)
from bps_tf.runtime.process_sets import (ProcessSet, add_process_set, global_process_set,
                                         remove_process_set)
from bps_tf.hooks import keras_shared
from bps_tf.hooks import registry as _registry
from bps_tf.strategy import keras_hooks as _strategy_hooks

# Rank-0-only progress bar, compile()'s Keras 2 argument, variable labels;
# tf.keras.__version__ under TF_USE_LEGACY_KERAS=1.
keras_shared.install()
# A LossScaleOptimizer around a DistributedOptimizer (Keras 3 under
# mixed_float16) agrees on inf/nan across workers, so an overflow on one
# worker skips the step on all of them instead of desynchronising the rounds.
_registry.locate_entry(_strategy_hooks.CHECK_FINITE)

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous",
    "Average", "Sum", "Compression", "DistributedOptimizer",
    "PartialDistributedOptimizer", "allreduce", "push_pull",
    "allgather", "allgather_object", "broadcast", "broadcast_object", "broadcast_variables",
    "broadcast_global_variables", "broadcast_model", "load_model", "callbacks",
    "SyncBatchNormalization",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "reducescatter", "start_timeline", "stop_timeline",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
]


def allreduce(value, name=None, average=None, prescale_factor=1.0,
              postscale_factor=1.0, op=None, compression=Compression.none):
    """Reduces a value (tensor, array or number) across workers; Horovod's
    Keras argument order."""
    return _tensor_allreduce(value, name=name, average=average, op=op,
                             prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor,
                             compression=compression)


def reducescatter(value, name=None, op=Average):
    """Reduces a value across workers and returns this worker's slice of the
    first dimension; Horovod's Keras argument order."""
    return _tensor_reducescatter(value, name=name, op=op)


def broadcast_model(model, root_rank=0):
    """Gives every worker ``root_rank``'s model (and built optimizer) state."""
    broadcast_variables(model_variables(model), root_rank=root_rank)


def broadcast_global_variables(root_rank):
    """tf_keras in a TF1 graph (eager execution disabled): broadcasts every
    global variable in the Keras session. Eager code (Keras 3 always) has no
    global variables: the error says what to use instead."""
    import tensorflow as tf
    if tf.executing_eagerly():
        raise NotImplementedError(
            "broadcast_global_variables needs a TF1 graph; eager Keras has no global "
            "variables. Use bps_tf.keras.callbacks.BroadcastGlobalVariablesCallback(root_rank) "
            "with fit, or bps_tf.keras.broadcast_model(model, root_rank) / "
            "broadcast_variables(variables, root_rank) in a custom loop.")
    from bps_tf.compat import tf1_session
    op = tf1_session.broadcast_global_variables(root_rank)
    # tf_keras' session holds the model's variables; a plain TF1 script's
    # default session otherwise.
    session = tf.compat.v1.get_default_session()
    backend = getattr(getattr(tf.compat.v1, "keras", None), "backend", None)
    if backend is not None and hasattr(backend, "get_session"):
        session = backend.get_session()
    if session is None:
        raise RuntimeError("broadcast_global_variables: no TF1 session to run the broadcast in")
    return session.run(op)


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, **kwargs):
    """``keras.models.load_model`` whose compiled optimizer comes back as a
    DistributedOptimizer, with its saved state. ``custom_optimizers`` (a list
    of classes) are added to ``custom_objects``. With ``TF_USE_LEGACY_KERAS=1``
    it is tf_keras' ``load_model`` (a Keras 2 model and optimizer)."""
    from bps_tf.runtime.config import tf_keras_enabled
    if tf_keras_enabled():
        import tensorflow as tf
        keras = tf.keras
    else:
        import keras
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects[cls.__name__] = cls
    model = keras.models.load_model(filepath, custom_objects=objects, **kwargs)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        make_distributed_in_place(optimizer, compression=compression)
    return model
