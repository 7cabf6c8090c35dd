"""Keras and TensorFlow classes found by the role they play, not by a
private name a release may change (bps_tf.hooks.registry uses them to
locate entries). Each raises :class:`HookMissing` with what it looked for.
"""
from __future__ import annotations

import sys

from bps_tf.hooks.registry import HookMissing, defining_class, public

KERAS_TRAINER_ROLE = "the class in keras.Model's MRO that defines make_train_function"
EPOCH_ITERATOR_ROLE = ("the EpochIterator subclass of the module of " + KERAS_TRAINER_ROLE +
                       " (TFEpochIterator)")


def backend_trainer():
    """The Keras backend trainer class: the class of ``keras.Model``'s MRO
    that defines ``make_train_function`` (TensorFlowTrainer up to Keras 3.15,
    Trainer in 3.16)."""
    return defining_class(public("keras.Model"), "make_train_function")


def epoch_iterator_class():
    """The TensorFlow epoch iterator Keras' backend trainer makes for fit,
    evaluate and predict: the class of the backend trainer's module that
    derives from an ``EpochIterator`` (TFEpochIterator in Keras 3.8-3.16)."""
    module = sys.modules[backend_trainer().__module__]
    found = [value for value in vars(module).values()
             if isinstance(value, type) and value.__module__ == module.__name__
             and any(base.__name__ == "EpochIterator" for base in value.__mro__[1:])]
    if len(found) != 1:
        raise HookMissing(f"{module.__name__} defines {len(found)} EpochIterator classes, not 1")
    return found[0]


def dataset_adapter_class():
    """The Keras data adapter class that serves a ``tf.data.Dataset`` as
    given: the class of what Keras' own ``get_data_adapter`` makes for one
    (the function found in the module of the class Keras' epoch iterator
    keeps its adapter in)."""
    import tensorflow as tf
    try:
        from keras.src.trainers.data_adapters import get_data_adapter  # role: Keras' own choice
    except ImportError as exc:
        raise HookMissing(f"keras' get_data_adapter cannot be imported ({exc})") from None
    return type(get_data_adapter(tf.data.Dataset.range(1)))


def concrete_function_class():
    """The class of a traced ``tf.function``'s concrete function."""
    import tensorflow as tf
    return type(tf.function(lambda: tf.constant(0)).get_concrete_function())


def keras_class(path: str):
    """A public Keras class (``keras.Layer``), as a role for a locator."""
    return lambda: public(path)
