"""``DistributedOptimizer`` for Keras 2 (``tf_keras``) optimizers.

With ``TF_USE_LEGACY_KERAS=1`` (Kubeflow images and the Keras examples of
Horovod and BytePS were written for it) ``tf.keras`` is ``tf_keras``, whose
optimizers -- the current ones and ``tf_keras.optimizers.legacy`` -- update
variables through ``apply_gradients(grads_and_vars, ...)``: ``minimize`` and
``Model.fit`` both end there. The wrapper is a subclass of the optimizer's
own class whose ``apply_gradients`` reduces the gradients first, so clipping,
weight decay and the update see the averaged gradients, as in Horovod.

tf_keras is imported by nobody here: an optimizer is recognised by the
module its classes come from, so bps_tf works without tf_keras installed.
"""
from __future__ import annotations

import logging

import tensorflow as tf

from bps_tf import api
from bps_tf.async_training import refuse_gradient_exchange


def is_tf_keras_optimizer(optimizer) -> bool:
    return any(cls.__module__.startswith("tf_keras.") for cls in type(optimizer).__mro__)


class _LegacyDistributedMixin:
    _bps_prefix = "DistributedOptimizer"
    _bps_compression = api.Compression.none
    _bps_sparse_as_dense = False
    _bps_op = api.Average
    _bps_priority_fn = None
    _bps_prescale = 1.0
    _bps_postscale = 1.0

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        # Under a tf.distribute strategy the strategy reduces the gradients.
        if grads_and_vars and not tf.distribute.has_strategy():
            grads, variables = zip(*grads_and_vars)
            reduced = api.reduce_gradients(
                list(grads), list(variables), self._bps_prefix,
                compression=self._bps_compression, sparse_as_dense=self._bps_sparse_as_dense,
                op=self._bps_op, priority_fn=self._bps_priority_fn,
                prescale_factor=self._bps_prescale, postscale_factor=self._bps_postscale)
            grads_and_vars = list(zip(reduced, variables))
        return super().apply_gradients(grads_and_vars, *args, **kwargs)


def DistributedOptimizer(optimizer, name=None, compression=api.Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0,
                         op=api.Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, priority_fn=None):
    """A copy of a tf_keras ``optimizer`` (same class, same config) that
    reduces gradients across workers before applying them."""
    refuse_gradient_exchange("DistributedOptimizer with a tf_keras optimizer")
    if isinstance(optimizer, _LegacyDistributedMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer.")
    if int(backward_passes_per_step) != 1:
        raise NotImplementedError(
            "backward_passes_per_step > 1 is not supported with a tf_keras (Keras 2) "
            "optimizer; accumulate gradients in your own loop, or use a Keras 3 optimizer "
            "(there it maps to gradient_accumulation_steps).")
    del average_aggregated_gradients   # only meaningful with backward_passes_per_step > 1
    op = api.resolve_op(None, op)
    prescale, postscale = api.predivide_scales(op, gradient_predivide_factor,
                                               "DistributedOptimizer")
    base = type(optimizer)
    settings = dict(
        _bps_prefix=name or "DistributedOptimizer",
        _bps_compression=compression,
        _bps_sparse_as_dense=bool(sparse_as_dense),
        _bps_op=op,
        _bps_priority_fn=staticmethod(priority_fn) if priority_fn else None,
        _bps_prescale=prescale,
        _bps_postscale=postscale,
        # Same name and module as the base: saved models name the plain class.
        __module__=base.__module__,
        __qualname__=base.__qualname__,
    )
    cls = type(base.__name__, (_LegacyDistributedMixin, base), settings)
    config = optimizer.get_config()
    if config.get("jit_compile"):
        # tf_keras turns XLA on by default where there is a GPU, and XLA
        # cannot compile the push_pull op: the update runs without it.
        logging.getLogger("bps_tf").warning(
            "DistributedOptimizer: jit_compile turned off for %s (XLA cannot compile "
            "bps_tf's push_pull).", base.__name__)
        config["jit_compile"] = False
    return cls.from_config(config)
