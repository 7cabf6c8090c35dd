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


def should_reduce(compression) -> bool:
    """Whether a DistributedOptimizer reduces the gradients itself: not
    under a tf.distribute strategy, which reduces them (twice would count
    them twice). There a compression of the wrapper's would be silently
    ignored, so it is refused. Shared by the Keras 3 and tf_keras wrappers."""
    if not tf.distribute.has_strategy():
        return True
    if compression not in (None, api.Compression.none):
        raise ValueError(
            "DistributedOptimizer(compression=...) under a tf.distribute strategy: the "
            "strategy reduces the gradients, so the wrapper's compression would be "
            "ignored. Pass it to the strategy instead: "
            "bps_tf.BytePSStrategy(compression=...), e.g. bps_tf.Compression.fp16 or "
            "bps_tf.Compression.topk(0.01, error_feedback=True).")
    return False


class LegacyDistributedMixin:
    """Put in front of a tf_keras optimizer's class by
    ``bps_tf.keras.optimizer.distributed_class``, which sets the ``_bps_*``
    settings as class attributes."""

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        if grads_and_vars and should_reduce(self._bps_compression):
            grads, variables = zip(*grads_and_vars)
            reduced = api.reduce_gradients(
                list(grads), list(variables), self._bps_prefix,
                compression=self._bps_compression, sparse_as_dense=self._bps_sparse_as_dense,
                op=self._bps_op, priority_fn=self._bps_priority_fn,
                prescale_factor=self._bps_prescale, postscale_factor=self._bps_postscale,
                process_set=self._bps_process_set)
            grads_and_vars = list(zip(reduced, variables))
        return super().apply_gradients(grads_and_vars, *args, **kwargs)


def check_supported(backward_passes_per_step) -> None:
    """Raises for what the tf_keras wrapper cannot do."""
    refuse_gradient_exchange("DistributedOptimizer with a tf_keras optimizer")
    if int(backward_passes_per_step) != 1:
        raise NotImplementedError(
            "backward_passes_per_step > 1 is not supported with a tf_keras (Keras 2) "
            "optimizer; accumulate gradients in your own loop, or use a Keras 3 optimizer "
            "(there it maps to gradient_accumulation_steps).")


def rebuild(cls, optimizer):
    """``cls`` (a distributed subclass of ``optimizer``'s class) built from
    ``optimizer``'s config."""
    config = optimizer.get_config()
    if config.get("jit_compile"):
        # tf_keras turns XLA on by default where there is a GPU, and XLA
        # cannot compile the push_pull op: the update runs without it.
        logging.getLogger("bps_tf").warning(
            "DistributedOptimizer: jit_compile turned off for %s (XLA cannot compile "
            "bps_tf's push_pull).", type(optimizer).__name__)
        config["jit_compile"] = False
    return cls.from_config(config)
