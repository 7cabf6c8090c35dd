"""``DistributedOptimizer`` for Keras 3 optimizers.

Keras 3 has none of the Keras-2 hooks Horovod overrides (``_aggregate_gradients``,
``get_gradients``). Every Keras 3 path that updates variables goes through
``optimizer.apply(grads, trainable_variables)``: ``apply_gradients`` calls it,
and so does the TensorFlow trainer behind ``model.fit``. The wrapper is a
dynamic subclass of the optimizer's own class whose ``apply`` reduces the
gradients first, so the result is still an ``Adam`` (or whatever it wraps),
keeps ``get_config``, and saves as the plain class.

Order inside one step: reduce (this wrapper) -> Keras clipping, weight decay,
update. Clipping therefore sees the averaged gradients, as in Horovod.

With gradient accumulation (``backward_passes_per_step > 1``, implemented by
Keras 3's ``gradient_accumulation_steps``) the reduction moves to the update
step, so workers exchange gradients once per ``backward_passes_per_step``
batches; there Keras clips the local accumulated gradients before the
reduction.

Under a ``tf.distribute`` strategy the strategy already reduces the
gradients (Keras calls its all-reduce), so the wrapper passes them through.

Under ``BYTEPS_ENABLE_ASYNC=1`` (outside a strategy) nothing is averaged:
``apply`` runs the wrapped optimizer on this worker's gradients, then pushes
each trainable variable's change and assigns the servers' value
(bps_tf.comm.async_training.exchange_all). The servers' copy must be started from
rank 0 first (``BroadcastGlobalVariablesCallback(0)`` or
``broadcast_variables``); tracing a step without it raises.
"""
from __future__ import annotations

import tensorflow as tf

from bps_tf.comm import async_training
from bps_tf.compat.pass_aggregation import passes_count
from bps_tf.horovod import api
from bps_tf.keras import legacy_optimizer, optimizer_entries


class _DistributedMixin(legacy_optimizer.ReduceMixin):
    """Methods put in front of the wrapped optimizer's class. The settings
    are class attributes of each generated class, so ``from_config`` on that
    class rebuilds an equally distributed optimizer."""

    _bps_prefix = "DistributedOptimizer"
    _bps_compression = api.Compression.none
    _bps_sparse_as_dense = False
    _bps_op = api.Average
    _bps_priority_fn = None
    _bps_accum_scale = 1.0   # Horovod sums (not averages) aggregated passes
    _bps_prescale = 1.0      # gradient_predivide_factor's split of the average
    _bps_postscale = 1.0

    def _bps_should_reduce(self) -> bool:
        # Inside a strategy the strategy's own all-reduce runs in
        # _backend_update_step: reducing here too would count twice.
        return legacy_optimizer.should_reduce(self._bps_compression)

    def _bps_accumulating(self) -> bool:
        steps = getattr(self, "gradient_accumulation_steps", None)
        return bool(steps) and steps > 1

    def _bps_async(self) -> bool:
        # Under a strategy the strategy's mode decides (BytePSStrategy reads
        # the same switch for its default).
        return async_training.enabled() and not tf.distribute.has_strategy()

    def _bps_apply_async(self, grads, trainable_variables):
        if self._bps_compression not in (None, api.Compression.none):
            raise ValueError("DistributedOptimizer(compression=...) in asynchronous training "
                             "(BYTEPS_ENABLE_ASYNC=1): the servers keep full-precision "
                             "weights; drop the compression.")
        variables = list(optimizer_entries.TRAINABLE.get(self) if trainable_variables is None
                         else trainable_variables)
        return async_training.exchange_all(
            variables, lambda: super(_DistributedMixin, self).apply(grads, trainable_variables))

    def apply(self, grads, trainable_variables=None):
        if self._bps_async():
            return self._bps_apply_async(grads, trainable_variables)
        if self._bps_should_reduce() and not self._bps_accumulating() and len(grads):
            variables = (optimizer_entries.TRAINABLE.get(self) if trainable_variables is None
                         else trainable_variables)
            grads = self._bps_reduce(grads, variables)
        return super().apply(grads, trainable_variables)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        # Reached once per update; with accumulation that is once every
        # gradient_accumulation_steps batches, on the averaged local passes.
        if self._bps_should_reduce() and self._bps_accumulating() and not self._bps_async():
            grads = self._bps_reduce(grads, trainable_variables,
                                     postscale_factor=self._bps_accum_scale)
        return super()._backend_update_step(grads, trainable_variables, learning_rate)


def distributed_class(base, name=None, compression=api.Compression.none,
                      sparse_as_dense=False, op=api.Average, priority_fn=None,
                      accum_scale=1.0, prescale=1.0, postscale=1.0, mixin=None,
                      process_set=None, passes=1, average_passes=False, scale_local=True):
    """A subclass of ``base`` that reduces gradients before applying them;
    ``mixin`` is the Keras 3 one unless given (tf_keras has its own)."""
    settings = dict(
        _bps_prefix=name or "DistributedOptimizer",
        _bps_compression=compression,
        _bps_sparse_as_dense=bool(sparse_as_dense),
        _bps_op=api.resolve_op(None, op),
        _bps_priority_fn=staticmethod(priority_fn) if priority_fn else None,
        _bps_accum_scale=float(accum_scale),
        _bps_prescale=float(prescale),
        _bps_postscale=float(postscale),
        _bps_process_set=process_set,
        _bps_passes=int(passes),             # tf_keras: local aggregation
        _bps_average_passes=bool(average_passes),
        _bps_scale_local=bool(scale_local),
        # Same name and module as the base: saved models name the plain class.
        __module__=base.__module__,
        __qualname__=base.__qualname__,
    )
    optimizer_entries.require(legacy=mixin is not None)
    return type(base.__name__, (mixin or _DistributedMixin, base), settings)


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=api.Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=api.Average,
                         backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=None, scale_local_gradients=True, priority_fn=None):
    """Returns a copy of a Keras 3 ``optimizer`` (same class, same config)
    that averages gradients across workers before applying them. A
    ``tf.compat.v1.train.Optimizer`` gets bps_tf.compat.v1.DistributedOptimizer.

    ``name`` prefixes the gradient names (default ``DistributedOptimizer``);
    gradients are named after the variables' ``.path`` and prioritised by
    their position. ``backward_passes_per_step=N`` accumulates N batches
    locally (Keras 3 ``gradient_accumulation_steps``) and exchanges once;
    the N passes are summed as in Horovod unless
    ``average_aggregated_gradients=True``. ``gradient_predivide_factor``
    (with ``op=Average``) divides by the factor before the sum and by
    ``size / factor`` after it, as in Horovod. ``device_dense``,
    ``device_sparse``, ``num_groups`` and ``groups`` are accepted for
    compatibility (the engine batches what is ready on its own).
    ``register_local_var(var)`` keeps a variable's gradient on this worker
    (divided by the size when ``scale_local_gradients``, as in Horovod). A tf_keras (Keras 2,
    ``TF_USE_LEGACY_KERAS=1``) optimizer gets the same wrapper for Keras 2
    (``bps_tf.keras.legacy_optimizer``).

    XLA cannot compile the push_pull op: on a machine with a GPU, where
    Keras' ``jit_compile="auto"`` turns XLA on, compile the model with
    ``jit_compile=False`` (the op refuses XLA with a message saying so).
    """
    from bps_tf.compat import v1
    from bps_tf.runtime.process_sets import resolve
    resolve(process_set, "DistributedOptimizer", members_only=False)
    del num_groups, groups
    if v1.is_v1_optimizer(optimizer):   # a TF1 optimizer: Horovod's TF1 wrapper
        return v1.DistributedOptimizer(
            optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
            op=op, priority_fn=priority_fn, process_set=process_set,
            gradient_predivide_factor=gradient_predivide_factor,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients)
    del device_dense, device_sparse
    if isinstance(optimizer, (_DistributedMixin, legacy_optimizer.LegacyDistributedMixin)):
        raise ValueError("this optimizer is already a DistributedOptimizer.")
    tf_keras = legacy_optimizer.is_tf_keras_optimizer(optimizer)
    if not tf_keras and not _is_keras3_optimizer(optimizer):
        raise TypeError("DistributedOptimizer wraps a Keras 3 optimizer (keras.optimizers.*), "
                        "a tf_keras one or a tf.compat.v1 one, got "
                        f"{type(optimizer).__name__}.")
    op = api.resolve_op(None, op)
    prescale, postscale = api.predivide_scales(op, gradient_predivide_factor,
                                               "DistributedOptimizer")
    if tf_keras:   # Keras 2: no gradient_accumulation_steps; pass_aggregation sums
        legacy_optimizer.check_supported(backward_passes_per_step)
        cls = distributed_class(type(optimizer), name=name, compression=compression,
                                sparse_as_dense=sparse_as_dense, op=op, priority_fn=priority_fn,
                                prescale=prescale, postscale=postscale,
                                mixin=legacy_optimizer.LegacyDistributedMixin,
                                process_set=process_set, passes=backward_passes_per_step,
                                average_passes=average_aggregated_gradients,
                                scale_local=scale_local_gradients)
        return legacy_optimizer.rebuild(cls, optimizer)
    passes = passes_count(backward_passes_per_step)
    config = optimizer.get_config()
    if passes > 1:
        existing = config.get("gradient_accumulation_steps")
        if existing not in (None, 1, passes):
            raise ValueError(
                f"the optimizer already accumulates {existing} steps; "
                f"backward_passes_per_step={passes} would disagree.")
        config["gradient_accumulation_steps"] = passes
    accum_scale = passes if passes > 1 and not average_aggregated_gradients else 1.0
    cls = distributed_class(type(optimizer), name=name, compression=compression,
                            sparse_as_dense=sparse_as_dense, op=op,
                            priority_fn=priority_fn, accum_scale=accum_scale,
                            prescale=prescale, postscale=postscale, process_set=process_set,
                            scale_local=scale_local_gradients)
    return cls.from_config(config)


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=api.Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=api.Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=None, local_layers=None,
                                scale_local_gradients=True):
    """A ``DistributedOptimizer`` that keeps the gradients of
    ``local_layers`` (a layer or a list of them) on this worker, as
    Horovod's: their trainable variables are ``register_local_var``-ed."""
    if local_layers is None:
        local_layers = []
    elif not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    from bps_tf.compat import v1
    if v1.is_v1_optimizer(optimizer):
        raise NotImplementedError(
            "PartialDistributedOptimizer wraps a Keras 3 or tf_keras optimizer; a "
            "tf.compat.v1 optimizer cannot keep gradients local. Use "
            "bps_tf.PartialDistributedGradientTape with it, or a Keras optimizer.")
    opt = DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            opt.register_local_var(var)
    return opt


def make_distributed_in_place(optimizer, **kwargs):
    """Turns an existing optimizer (with its state, e.g. just loaded) into a
    distributed one by switching its class; used by ``load_model``."""
    if isinstance(optimizer, (_DistributedMixin, legacy_optimizer.LegacyDistributedMixin)):
        return optimizer
    if legacy_optimizer.is_tf_keras_optimizer(optimizer):
        kwargs["mixin"] = legacy_optimizer.LegacyDistributedMixin
    optimizer_entries.swap_class(optimizer, distributed_class(type(optimizer), **kwargs))
    return optimizer


def _is_keras3_optimizer(optimizer) -> bool:
    import keras
    return isinstance(optimizer, keras.optimizers.Optimizer)
