"""Helpers that Horovod scripts and tests reach as ``hvd.util`` /
``horovod.tensorflow.util``: ``_executing_eagerly`` (the question every
Horovod path asks before choosing eager or graph code)."""
from __future__ import annotations

from bps_tf.runtime.config import tf_keras_enabled  # noqa: F401  (hvd.util's users)


def _executing_eagerly():
    """True in eager execution (TF2's default), False while building a graph
    (inside a ``tf.function`` or a TF1 graph)."""
    import tensorflow as tf
    return tf.executing_eagerly()
