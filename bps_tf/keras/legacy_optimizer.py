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

from bps_tf.comm.async_training import refuse_gradient_exchange
from bps_tf.compat.pass_aggregation import PassAggregator, passes_count
from bps_tf.horovod import api
from bps_tf.horovod.tape import reduce_except_local, source_key


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


class ReduceMixin:
    """What the Keras 3 and tf_keras wrappers share: the reduction, and
    Horovod's ``register_local_var``. Settings are class attributes set by
    ``bps_tf.keras.optimizer.distributed_class``."""

    _bps_scale_local = True

    def register_local_var(self, var):
        """Marks ``var`` as this worker's own (Horovod's name): its gradient
        is not reduced across workers, only divided by the process set's
        size when ``scale_local_gradients`` (the default)."""
        self.__dict__.setdefault("_bps_local_keys", set()).add(source_key(var))

    def _bps_reduce(self, grads, variables, postscale_factor=1.0):
        return reduce_except_local(
            list(grads), list(variables), self._bps_prefix,
            self.__dict__.get("_bps_local_keys", ()), self._bps_scale_local,
            compression=self._bps_compression, sparse_as_dense=self._bps_sparse_as_dense,
            op=self._bps_op, priority_fn=self._bps_priority_fn,
            prescale_factor=self._bps_prescale,
            postscale_factor=postscale_factor * self._bps_postscale,
            process_set=self._bps_process_set, local_factor=postscale_factor)


class LegacyDistributedMixin(ReduceMixin):
    """Put in front of a tf_keras optimizer's class by
    ``bps_tf.keras.optimizer.distributed_class``, which sets the ``_bps_*``
    settings as class attributes."""

    _bps_passes = 1
    _bps_average_passes = False

    @property
    def _agg_helper(self):
        """The local sums of ``backward_passes_per_step > 1`` (None
        otherwise), made on first use so that ``from_config`` copies
        aggregate too."""
        if self._bps_passes < 2:
            return None
        helper = self.__dict__.get("_bps_aggregator")
        if helper is None:
            helper = PassAggregator(self._bps_passes, self._bps_average_passes)
            self.__dict__["_bps_aggregator"] = helper
        return helper

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        # Horovod reduces here (minimize and tf_keras' fit come this way), and
        # scripts read these gradients, e.g. to clip or log them: the next
        # apply_gradients takes them as reduced, as Horovod's does. Called
        # alone, apply_gradients reduces itself.
        grads_and_vars = super()._compute_gradients(loss, var_list, grad_loss=grad_loss,
                                                    tape=tape)
        return self._bps_reduce_pairs(grads_and_vars)

    def get_gradients(self, loss, params):
        grads = super().get_gradients(loss, params)
        return [g for g, _ in self._bps_reduce_pairs(list(zip(grads, params)))]

    def _bps_reduce_pairs(self, grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        if (self._bps_passes > 1 or not grads_and_vars
                or not should_reduce(self._bps_compression)):
            return grads_and_vars   # aggregation reduces in apply_gradients
        grads, variables = zip(*grads_and_vars)
        reduced = self._bps_reduce(grads, variables)
        self.__dict__["_bps_reduced_pending"] = True
        return list(zip(reduced, variables))

    def _bps_already_reduced(self) -> bool:
        return bool(self.__dict__.pop("_bps_reduced_pending", False))

    def aggregate_gradients(self, grads_and_vars):
        # tf_keras' LossScaleOptimizer (mixed precision) sums the gradients
        # here, before its inf/nan check, so that every worker checks the same
        # sums and all skip or apply the step together. The base
        # apply_gradients calls this too, after this wrapper has reduced.
        grads_and_vars = super().aggregate_gradients(grads_and_vars)
        if self.__dict__.get("_bps_applying"):
            return grads_and_vars
        self.__dict__.pop("_bps_reduced_pending", None)   # a skipped step's is stale
        return self._bps_reduce_pairs(grads_and_vars)

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        reduce = should_reduce(self._bps_compression)
        if self._bps_passes > 1:
            if not reduce:
                raise ValueError(
                    "DistributedOptimizer(backward_passes_per_step > 1) with a tf_keras "
                    "optimizer under a tf.distribute strategy: the strategy reduces every "
                    "batch. Use the wrapper without a strategy, or a Keras 3 optimizer "
                    "(gradient_accumulation_steps).")
            base = super()
            return self._agg_helper.apply(
                grads_and_vars, self._bps_reduce,
                lambda pairs: base.apply_gradients(pairs, *args, **kwargs),
                lambda: self.iterations.assign_add(1))
        if not self._bps_already_reduced() and grads_and_vars and reduce:
            grads, variables = zip(*grads_and_vars)
            grads_and_vars = list(zip(self._bps_reduce(grads, variables), variables))
        self.__dict__["_bps_applying"] = True
        try:
            return super().apply_gradients(grads_and_vars, *args, **kwargs)
        finally:
            self.__dict__.pop("_bps_applying", None)


def check_supported(backward_passes_per_step) -> None:
    """Raises for what the tf_keras wrapper cannot do."""
    refuse_gradient_exchange("DistributedOptimizer with a tf_keras optimizer")
    passes_count(backward_passes_per_step)


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
