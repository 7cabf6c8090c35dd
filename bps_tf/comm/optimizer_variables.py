"""Keras 2's ``optimizer.variables()`` and ``optimizer.lr`` on Keras 3
optimizers.

Horovod's TF2 examples broadcast the optimizer's state with
``hvd.broadcast_variables(opt.variables(), root_rank=0)``; in Keras 3
``variables`` is a property holding a list, so the call fails. Horovod's
elastic scripts set the learning rate after a membership change with
``optimizer.lr.assign(...)``; Keras 3 dropped the ``lr`` alias. No
TensorFlow at import: ``bps_tf.init()`` installs both once Keras is loaded.
"""
from __future__ import annotations

from bps_tf.hooks import registry as hooks

GROUP = "horovod"


class _CallableVariables(list):
    """Keras 3's ``optimizer.variables`` (a list) that also answers Keras 2's
    ``optimizer.variables()``."""

    def __call__(self):
        return self


@hooks.register("keras.optimizers.Optimizer.variables", GROUP,
                hooks.attribute_of("keras.optimizers.Optimizer", "variables"),
                changes="the list of variables can also be called, as Keras 2's method",
                why="Horovod's TF2 scripts call optimizer.variables(); Keras 3 made it a "
                    "property", when_missing="cosmetic")
def _callable_variables(original):
    if not isinstance(original, property):
        raise hooks.HookMissing("keras.optimizers.Optimizer.variables is not a property")

    def variables(self):
        return _CallableVariables(original.fget(self))
    return property(variables, doc=original.__doc__)


@hooks.register("keras.optimizers.Optimizer._get_current_learning_rate", GROUP,
                hooks.attribute_of("keras.optimizers.Optimizer", "_get_current_learning_rate",
                                   defined_by_role=True),
                changes="optimizer.lr: Keras 2's alias of learning_rate (read through this "
                        "method, as learning_rate reads it; set as learning_rate is set)",
                why="Horovod's elastic scripts call optimizer.lr.assign(); Keras 3 has no lr",
                when_missing="cosmetic", private=True, kind="uses")
def _lr_alias(original):
    owner = hooks.public("keras.optimizers.Optimizer")
    if not hasattr(owner, "lr"):     # a Keras that has its own lr keeps it
        owner.lr = property(original, owner.learning_rate.fset,
                            doc="Keras 2's name of learning_rate (bps_tf's Horovod face).")
    return original


def install() -> None:
    """Makes ``optimizer.variables()`` and ``optimizer.lr`` work on Keras 3
    optimizers (once)."""
    hooks.install(GROUP)
