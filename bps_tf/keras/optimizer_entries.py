"""What ``bps_tf.keras.DistributedOptimizer`` touches of Keras besides its
public API, each a registry entry (bps_tf.hooks): the private method its
generated subclass overrides, the optimizer's own list of the variables it
was built with, the class swap of ``load_model``, and tf_keras' legacy
method. When a release moves one, ``DistributedOptimizer`` (and only it)
refuses with an error naming the entry and the versions.
"""
from __future__ import annotations

from bps_tf.hooks import registry
from bps_tf.hooks.entries import PrivateAttribute, defined_by
from bps_tf.hooks.roles import keras_class

GROUP = "keras.optimizer"
FEATURE = "bps_tf.keras.DistributedOptimizer"
_OPTIMIZER = keras_class("keras.optimizers.Optimizer")
_WHY = ("Horovod's DistributedOptimizer reduces the gradients inside the optimizer; Keras 3 "
        "hands them on privately between apply() and the update")

registry.probe("keras.optimizers.Optimizer._backend_update_step (overridden)", GROUP,
               defined_by(_OPTIMIZER, "_backend_update_step", "keras.optimizers.Optimizer"),
               changes="with gradient accumulation, the accumulated gradients are reduced "
                       "where Keras applies them", why=_WHY, when_missing="error",
               feature=FEATURE)
TRAINABLE = PrivateAttribute(
    "keras.optimizers.Optimizer._trainable_variables", GROUP, _OPTIMIZER,
    "_trainable_variables", ("__init__", "build"), "keras.optimizers.Optimizer",
    changes="read: the variables an apply() without variables updates", why=_WHY,
    when_missing="error", feature=FEATURE)


def _swappable():
    return registry.public("keras.optimizers.Optimizer"), "__class__"


_swappable.found_by = "public name keras.optimizers.Optimizer (its instances' __class__)"
_swappable.keras_name = "Optimizer"
registry.probe("keras optimizer class swap (load_model)", GROUP, _swappable,
               changes="a loaded optimizer becomes distributed with its state: its class is "
                       "swapped for a generated subclass", why="load_model builds the "
                                                               "optimizer itself; its state "
                                                               "cannot be handed to a new one",
               when_missing="error", feature=FEATURE, private=False, kind="patches")
registry.probe("tf_keras OptimizerV2._compute_gradients", "tf_keras",
               defined_by(lambda: registry.public("tf_keras.optimizers.legacy.Optimizer"),
                          "_compute_gradients", "tf_keras.optimizers.legacy.Optimizer"),
               changes="overridden: the gradients of minimize() and tf_keras' fit are reduced "
                       "where Horovod's are", why=_WHY, when_missing="error",
               feature=FEATURE + " (tf_keras)")


def require(legacy: bool = False) -> None:
    """Raises HookError when an entry the DistributedOptimizer needs moved."""
    if legacy:
        registry.require_entry("tf_keras OptimizerV2._compute_gradients")
        return
    registry.install(GROUP)
    registry.require(GROUP, FEATURE, policy=None)
    for hook in registry.hooks(GROUP):
        registry.require_entry(hook.name)


def swap_class(optimizer, cls) -> None:
    """``optimizer``'s class becomes ``cls`` (a subclass of its own)."""
    registry.require_entry("keras optimizer class swap (load_model)")
    try:
        optimizer.__class__ = cls
    except TypeError as exc:
        registry.mark_missing("keras optimizer class swap (load_model)", str(exc))
        registry.require_entry("keras optimizer class swap (load_model)")
