"""A global batch that the worker count does not divide: each replica's loss
weighted by its share of the batch.

tf.distribute splits a global batch unevenly between replicas when it must
(64 rows over 3 workers: 22, 22 and 20; the last, partial batch of an epoch
too), and Keras 3 then scales each replica's mean loss by
``1 / num_replicas_in_sync``: the summed gradient is the mean of the
replicas' means, not the gradient of the global batch, and the replicas'
first batches (which Keras reduces across replicas to learn the input
shapes) no longer have one shape. Here:

- each replica's batch size is noted when the strategy runs the step
  (``recording``, from BytePSExtended._call_for_each_replica);
- ``Optimizer.scale_loss`` (what Keras' train step calls on the loss it
  differentiates; ``LossScaleOptimizer``'s too) multiplies the loss by
  ``n_r * R / N``: ``n_r`` this replica's rows, ``R`` the replicas in sync,
  ``N`` the rows of every replica (one scalar sum, which runs while the
  forward pass does). With Keras' ``1/R`` the replica's gradient then has
  the weight ``n_r / N``, and the sum over replicas is the gradient of the
  global batch's mean, as one process would compute it. When the shares are
  equal the factor is exactly 1.0 and nothing changes, bit for bit;
- Keras' symbolic build takes the first local replica's batch instead of a
  cross-worker mean of every replica's (only its shapes are used).

Terms that Keras scales by ``1/R`` and that do not depend on the batch
(regularization losses) keep their weight: the shares sum to one. A loss
reduced as a plain sum (``reduction="sum"``, which Keras does not scale)
would be weighted wrongly by an uneven split: docs/strategy.md says so. A
custom train step that does not call ``optimizer.scale_loss`` keeps Keras'
``1/R``.
"""
from __future__ import annotations

import functools
import threading

import tensorflow as tf

from bps_tf.hooks import registry as hooks
from bps_tf.hooks import roles

GROUP = "keras"
_local = threading.local()
_WHY = ("Keras 3 scales each replica's loss by 1/num_replicas_in_sync whatever its share of the "
        "batch; tf.distribute leaves the weighting to the loss (compute_average_loss), which "
        "Keras' train step does not use")


def recording(fn):
    """``fn`` (a replica's step) noting its batch size for ``weighted``."""
    if isinstance(fn, tf.types.experimental.GenericFunction):
        return fn   # a tf.function keeps tf.distribute's own path

    # No functools.wraps: AutoGraph would convert ``fn`` (its __wrapped__)
    # in place of this wrapper.
    def replica_step(*args, **kwargs):
        saved = getattr(_local, "share", None)
        _local.share = _rows(args, kwargs)
        try:
            return fn(*args, **kwargs)
        finally:
            _local.share = saved
    return replica_step


def _rows(args, kwargs):
    """The leading dimension of the first batched tensor of the step's
    arguments (Keras' own choice: the first of x), as float32; or None."""
    for value in tf.nest.flatten((args, kwargs)):
        if tf.is_tensor(value) and value.shape.rank:
            return tf.cast(tf.shape(value)[0], tf.float32)
    return None


def weighted(loss):
    """``loss`` times ``n_r * R / N`` inside a replica step of a strategy
    with more than one replica (1.0 when the shares are equal)."""
    share = getattr(_local, "share", None)
    if share is None or not tf.distribute.has_strategy() or \
            tf.distribute.in_cross_replica_context():
        return loss
    context = tf.distribute.get_replica_context()
    replicas = context.num_replicas_in_sync
    if context is None or replicas <= 1:
        return loss
    total = context.all_reduce(tf.distribute.ReduceOp.SUM, share)
    factor = (share * float(replicas)) / total
    return loss * tf.cast(factor, loss.dtype)


def _scale_loss(original):
    @functools.wraps(original)
    def scale_loss(self, loss):
        if getattr(_local, "scaling", False):   # an override that calls the base
            return original(self, loss)
        _local.scaling = True
        try:
            scaled = original(self, loss)
        finally:
            _local.scaling = False
        return weighted(scaled)
    return scale_loss


for _owner in ("keras.optimizers.Optimizer", "keras.optimizers.LossScaleOptimizer"):
    hooks.register(
        f"{_owner}.scale_loss", GROUP,
        hooks.attribute_of(_owner, "scale_loss", defined_by_role=True),
        changes="under BytePSStrategy, weights each replica's loss by its share of the global "
                "batch (a batch the replicas do not split evenly trains as in one process)",
        why=_WHY, when_missing="fallback")(_scale_loss)


def symbolic_build() -> bool:
    """True while Keras reduces a first batch to learn its shapes."""
    return getattr(_local, "symbolic", False)


@hooks.register("keras backend trainer._maybe_symbolic_build", GROUP,
                lambda: (hooks.defining_class(roles.backend_trainer(), "_maybe_symbolic_build"),
                         "_maybe_symbolic_build"),
                changes="the first batch's shapes come from this worker's first replica "
                        "instead of a mean over every replica's batch",
                why="Keras averages the replicas' first batches across workers only to read "
                    "their shapes; with uneven shares they differ, and the mean fails",
                when_missing="fallback", private=True,
                found_by="role: the class of the backend trainer's MRO that defines "
                         "_maybe_symbolic_build")
def _maybe_symbolic_build(original):
    @functools.wraps(original)
    def maybe_symbolic_build(self, *args, **kwargs):
        saved = symbolic_build()
        _local.symbolic = True
        try:
            return original(self, *args, **kwargs)
        finally:
            _local.symbolic = saved
    return maybe_symbolic_build
