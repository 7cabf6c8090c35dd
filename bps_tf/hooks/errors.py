"""The two errors of the hook registry (bps_tf.hooks.registry re-exports them)."""


class HookMissing(LookupError):
    """An entry's target was not found where its role says it is."""


class HookError(RuntimeError):
    """A feature needs an entry whose target this Keras/TensorFlow moved."""
