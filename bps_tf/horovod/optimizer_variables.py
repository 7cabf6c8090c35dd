"""Keras 2's ``optimizer.variables()`` on Keras 3 optimizers.

Horovod's TF2 examples broadcast the optimizer's state with
``hvd.broadcast_variables(opt.variables(), root_rank=0)``; in Keras 3
``variables`` is a property holding a list, so the call fails. No
TensorFlow at import: ``bps_tf.init()`` installs it once Keras is loaded.
"""
from __future__ import annotations


class _CallableVariables(list):
    """Keras 3's ``optimizer.variables`` (a list) that also answers Keras 2's
    ``optimizer.variables()``."""

    def __call__(self):
        return self


def install() -> None:
    """Makes ``optimizer.variables()`` work on Keras 3 optimizers (once; a
    no-op without Keras)."""
    try:
        from keras.src.optimizers import base_optimizer
    except ImportError:
        return
    cls = base_optimizer.BaseOptimizer
    original = cls.__dict__.get("variables")
    if not isinstance(original, property) or getattr(original.fget, "_bps_callable", False):
        return

    def variables(self):
        return _CallableVariables(original.fget(self))

    variables._bps_callable = True
    cls.variables = property(variables, doc=original.__doc__)
