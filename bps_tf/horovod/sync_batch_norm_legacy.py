"""``SyncBatchNormalization`` for tf_keras (``TF_USE_LEGACY_KERAS=1``); see
``bps_tf.horovod.sync_batch_norm``. Imported only when tf.keras is tf_keras."""
from __future__ import annotations

import tensorflow as tf

from bps_tf.hooks import registry
from bps_tf.horovod.sync_batch_norm_entries import LEGACY_ENTRY
from bps_tf.horovod.sync_moments import global_moments
from bps_tf.runtime import basics


@tf.keras.utils.register_keras_serializable(package="bps_tf")
class SyncBatchNormalization(tf.keras.layers.BatchNormalization):
    """tf_keras ``BatchNormalization`` whose training statistics are computed
    over the batches of all workers (same arguments; never fused)."""

    def __init__(self, fused=False, **kwargs):
        if fused:
            raise ValueError("SyncBatchNormalization(fused=True): the fused kernel computes the "
                             "moments of this worker's batch alone; leave fused unset or False.")
        kwargs.setdefault("name", "sync_batch_normalization")
        registry.require_entry(LEGACY_ENTRY)
        super().__init__(fused=False, **kwargs)

    def _calculate_mean_and_var(self, inputs, reduction_axes, keep_dims, mask=None):
        if not basics.is_initialized():
            return super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask=mask)
        weights = None if mask is None else tf.expand_dims(mask, -1)
        return global_moments(inputs, list(reduction_axes), weights, self.name,
                              keepdims=keep_dims)
