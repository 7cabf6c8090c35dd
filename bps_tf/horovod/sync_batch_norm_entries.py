"""What ``SyncBatchNormalization`` touches of Keras (and tf_keras) besides its
public API: the private method computing a batch's moments, which it
overrides, and the axes Keras keeps for it. Registry entries (bps_tf.hooks):
when a release moves one, ``SyncBatchNormalization`` (and only it) refuses
with an error naming the entry and the versions.
"""
from __future__ import annotations

from bps_tf.hooks import registry
from bps_tf.hooks.entries import PrivateAttribute, defined_by
from bps_tf.hooks.roles import keras_class

GROUP = "horovod.sync_batch_norm"
FEATURE = "SyncBatchNormalization"
_WHY = ("BatchNormalization computes a batch's moments in one private method; no public "
        "option gives it the moments of every worker's batch")
_BN = keras_class("keras.layers.BatchNormalization")
MOMENTS = "keras.layers.BatchNormalization._moments (overridden)"
registry.probe(MOMENTS, GROUP,
               defined_by(_BN, "_moments", "keras.layers.BatchNormalization"),
               changes="the moments of a training batch are those of every worker's batch",
               why=_WHY, when_missing="error", feature=FEATURE)
REDUCTION_AXES = PrivateAttribute(
    "keras.layers.BatchNormalization._reduction_axes", GROUP, _BN, "_reduction_axes",
    ("build",), "keras.layers.BatchNormalization",
    changes="read: the axes the moments are taken over", why=_WHY, when_missing="error",
    feature=FEATURE)
LEGACY_ENTRY = "tf_keras BatchNormalization._calculate_mean_and_var (overridden)"
registry.probe(LEGACY_ENTRY, "tf_keras",
               defined_by(lambda: registry.public("tf_keras.layers.BatchNormalization"),
                          "_calculate_mean_and_var", "tf_keras.layers.BatchNormalization"),
               changes="the moments of a training batch are those of every worker's batch",
               why=_WHY, when_missing="error", feature=FEATURE + " (tf_keras)")
