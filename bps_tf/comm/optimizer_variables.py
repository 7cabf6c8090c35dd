"""Keras 2's ``optimizer.variables()`` on Keras 3 optimizers.

Horovod's TF2 examples broadcast the optimizer's state with
``hvd.broadcast_variables(opt.variables(), root_rank=0)``; in Keras 3
``variables`` is a property holding a list, so the call fails. No
TensorFlow at import: ``bps_tf.init()`` installs it once Keras is loaded.
"""
from __future__ import annotations

from bps_tf.runtime import hooks

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


def install() -> None:
    """Makes ``optimizer.variables()`` work on Keras 3 optimizers (once)."""
    hooks.install(GROUP)
