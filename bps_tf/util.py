"""Helpers that Horovod scripts and tests reach as ``hvd.util`` /
``horovod.tensorflow.util``: ``_executing_eagerly`` (the question every
Horovod path asks before choosing eager or graph code)."""
from __future__ import annotations


def tf_keras_enabled() -> bool:
    """True when ``tf.keras`` is tf_keras (Keras 2): ``TF_USE_LEGACY_KERAS``
    set to one of the values TensorFlow itself accepts."""
    import os
    return os.environ.get("TF_USE_LEGACY_KERAS", "") in ("1", "true", "True")


def _executing_eagerly():
    """True in eager execution (TF2's default), False while building a graph
    (inside a ``tf.function`` or a TF1 graph)."""
    import tensorflow as tf
    return tf.executing_eagerly()
