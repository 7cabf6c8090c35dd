"""The Horovod/BytePS-style TensorFlow API, built on ``bps_tf.comm.collectives``.

* ``push_pull`` / ``allreduce``: sum, then average (``op=Average``, the default).
* ``allgather``: rows of every worker, concatenated in rank order.
* ``broadcast`` / ``broadcast_variables`` / ``broadcast_object``.
* ``reduce_gradients``: the gradient reduction behind
  ``DistributedGradientTape`` (``bps_tf.horovod.tape``) and the Keras
  ``DistributedOptimizer``.

Names. Workers match tensors by name, so every worker must give the same
tensor the same name: an explicit ``name=`` always wins; inside a
``tf.function`` the name comes from the tensor's op name; unnamed eager calls
are numbered, so they must happen in the same order on every worker. The
name given to the op carries a family prefix (``PushPull/``, ``Broadcast/``,
``Allgather/`` ...) so that, say, a broadcast and a push_pull named ``w``
never meet on one key. The whole contract is in ``bps_tf.comm.naming``.

Averages. Floating tensors are divided by ``size()``. Integer tensors are
floor-divided (``tf.math.floordiv``), which keeps their dtype: the average of
3 and 4 over 2 workers is 3, of -3 and -4 is -4.
"""
from __future__ import annotations

import tensorflow as tf

from bps_tf.comm import collectives
from bps_tf.comm.allreduce import allreduce as _allreduce
from bps_tf.comm.allreduce import reduce_gradients
from bps_tf.comm.collectives import SUPPORTED_DTYPES, require_init
from bps_tf.comm.compression import Compression, Compressor, FP16Compressor, NoneCompressor
from bps_tf.comm.exchange import (allgather, allgather_object, broadcast, broadcast_object,
                                  broadcast_object_fn, broadcast_variables, check_set_root)
from bps_tf.comm.naming import variable_name
from bps_tf.comm.reduction import (SERVER_OPS, Adasum, Average, Max, Min, Product, ReduceOp,
                                   Sum, predivide_scales, resolve_op)
from bps_tf.runtime import process_sets
from bps_tf.runtime.process_sets import global_process_set

__all__ = [
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "Compression", "Compressor", "NoneCompressor", "FP16Compressor",
    "push_pull", "allreduce", "grouped_allreduce", "allgather", "broadcast",
    "broadcast_variables", "broadcast_object", "broadcast_object_fn", "allgather_object",
    "reduce_gradients", "predivide_scales", "resolve_op", "check_set_root",
    "variable_name", "SUPPORTED_DTYPES", "SERVER_OPS",
]


# --------------------------------------------------------------------------
# push_pull / allreduce
# --------------------------------------------------------------------------
def push_pull(tensor, average=None, name=None, compression=Compression.none,
              op=None, priority=0, device_dense="", device_sparse="",
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
              scope="", enable_async=False):
    """Reduces ``tensor`` across all workers (``op=Average`` by default).

    ``Sum``/``Average`` go through the servers' sum; ``Min``, ``Max`` and
    ``Product`` are computed exactly by the servers too, in the tensor's
    dtype (not with compression or in asynchronous training).

    ``prescale_factor`` multiplies before the sum, ``postscale_factor`` after
    the average. ``priority``: higher leaves first. An ``IndexedSlices`` is
    gathered (its values and indices concatenated over workers, values divided
    by ``size()`` for Average), as Horovod does.

    ``process_set``: a registered ProcessSet; only its members take part
    (and call this), the average divides by its size. Workers that pass
    different ops or sets under one name all fail, naming both.

    The average divides by the size of the membership the op *runs* in, so
    a ``tf.function`` traced before an elastic job's workers changed stays
    right after (docs/elastic.md).

    BytePS's ``push_pull(tensor, scope, average, ...)`` runs too: a string
    in the second place is its ``scope`` (names come from ``name`` or the
    tensor, so the scope is not needed for them); ``enable_async=True`` is
    refused, since asynchronous training here pushes weight deltas
    (``BytePSStrategy(mode="async")`` or ``BYTEPS_ENABLE_ASYNC=1`` with
    ``DistributedOptimizer``), not gradients through this call.
    """
    if isinstance(average, str):  # BytePS's positional order: (tensor, scope, average)
        scope, average = average, None
    del scope
    if enable_async:
        raise NotImplementedError(
            "push_pull(enable_async=True): asynchronous training pushes weight deltas, not "
            "gradients through push_pull; use BytePSStrategy(mode='async') or "
            "BYTEPS_ENABLE_ASYNC=1 with bps_tf.keras.DistributedOptimizer (docs/strategy.md).")
    op = resolve_op(average, op)
    return _allreduce(tensor, name=name, op=op, compression=compression, priority=priority,
                      prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                      process_set=process_set, device_dense=device_dense,
                      device_sparse=device_sparse)


def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, name=None, ignore_name_scope=False,
              priority=0, process_set=global_process_set):
    """``push_pull`` under Horovod's name and argument order.
    ``ignore_name_scope`` is accepted for compatibility and has no effect.
    As in Horovod, an ``IndexedSlices`` takes no pre/postscaling here
    (``NotImplementedError``; ``push_pull`` scales its values)."""
    del ignore_name_scope
    if isinstance(tensor, tf.IndexedSlices) and (prescale_factor != 1.0 or
                                                 postscale_factor != 1.0):
        raise NotImplementedError("allreduce: pre/postscaling is not supported with "
                                  "tf.IndexedSlices (as in Horovod).")
    return push_pull(tensor, average=average, name=name, compression=compression,
                     op=op, priority=priority, device_dense=device_dense,
                     device_sparse=device_sparse, prescale_factor=prescale_factor,
                     postscale_factor=postscale_factor, process_set=process_set)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, name=None, process_set=global_process_set):
    """``allreduce`` of a list; the ops run concurrently inside a tf.function."""
    process_sets.resolve(process_set, "grouped_allreduce")
    names = [None] * len(tensors) if name is None else \
        [f"{name}/{i}" for i in range(len(tensors))]
    return [allreduce(t, average=average, device_dense=device_dense,
                      device_sparse=device_sparse, compression=compression,
                      op=op, prescale_factor=prescale_factor,
                      postscale_factor=postscale_factor, name=n, process_set=process_set)
            for t, n in zip(tensors, names)]
