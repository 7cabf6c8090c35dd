"""What the overlap of ``model.fit`` touches of Keras and TensorFlow beyond
the hooks of bps_tf.overlap.fit: one optimizer's, one model's and one
iterator's methods replaced on that object only, the optimizer's iteration
count read in place of the pending step's, and Keras' weight-decay step,
copied. Each is a registry entry (bps_tf.hooks); when a release moves one,
the overlap is off for every model (the barrier gives the same weights),
with one warning.
"""
from __future__ import annotations

from bps_tf.hooks import registry
from bps_tf.hooks.entries import InstancePatch, Method, PrivateAttribute, code_names, defined_by
from bps_tf.hooks.roles import keras_class

GROUP = "overlap.fit"
_DEFERRED = ("the overlap applies one variable's update of the previous step, which Keras' "
             "public apply() cannot do")
_OPTIMIZER = keras_class("keras.optimizers.Optimizer")

WEIGHT_DECAY = InstancePatch(
    "keras.optimizers.Optimizer._apply_weight_decay (per optimizer)", GROUP, _OPTIMIZER,
    "_apply_weight_decay", "keras.optimizers.Optimizer",
    changes="inside a traced step, deferred to the update of the next step; Keras' own "
            "method applies it there, per variable", why=_DEFERRED, when_missing="fallback")
UPDATE_STEP = InstancePatch(
    "keras.optimizers.Optimizer._backend_update_step (per optimizer)", GROUP, _OPTIMIZER,
    "_backend_update_step", "keras.optimizers.Optimizer",
    changes="inside a traced step, only starts each dense gradient's push_pull", why=_DEFERRED,
    when_missing="fallback")
ITERATIONS = PrivateAttribute(
    "keras.optimizers.Optimizer._iterations", GROUP, _OPTIMIZER, "_iterations", ("__init__",),
    "keras.optimizers.Optimizer",
    changes="reads the pending gradients' step while their deferred update runs", why=_DEFERRED,
    when_missing="fallback")
USE_WEIGHT_DECAY = Method(
    "keras.optimizers.Optimizer._use_weight_decay", GROUP, _OPTIMIZER, "_use_weight_decay",
    "keras.optimizers.Optimizer", changes="called: whether a variable decays (Keras' own "
                                          "exclusions)", why=_DEFERRED, when_missing="fallback")
# Keras' weight-decay step, applied by the deferred update from a
# cross-replica context, where Keras' own method cannot merge: copied
# (variable -= variable * weight_decay * learning_rate, where
# _use_weight_decay says so). Found while Keras' step still reads what the
# copy reads and writes with what it writes.
_COPIED = ("_use_weight_decay", "weight_decay", "learning_rate", "assign_sub")


def _weight_decay_step():
    owner, attr = defined_by(_OPTIMIZER, "_apply_weight_decay", "")()
    method = vars(owner)[attr]
    gone = [n for n in _COPIED if n not in code_names(method)]
    if gone:
        raise registry.HookMissing(f"{owner.__name__}._apply_weight_decay no longer uses "
                                   f"{', '.join(gone)}: not the step bps_tf copies")
    return owner, attr


_weight_decay_step.found_by = ("role: the class of keras.optimizers.Optimizer's MRO that "
                               "defines _apply_weight_decay, whose code uses " +
                               ", ".join(_COPIED))
_weight_decay_step.keras_name = "_apply_weight_decay"
registry.probe("keras.optimizers.Optimizer._apply_weight_decay (step copied)", GROUP,
               _weight_decay_step, changes="the deferred update applies Keras' weight decay "
                                           "with a copy of its step",
               why=_DEFERRED + "; Keras' own method merges into a replica context, and the "
                               "deferred update runs in a cross-replica one",
               when_missing="fallback")
TRAIN_STEP = InstancePatch(
    "keras.Model.train_step (per model)", GROUP, keras_class("keras.Model"), "train_step",
    "keras.Model", changes="marks the traced step the overlap serves, and checks its reads "
                           "once traced", why="tf.distribute's run cannot tell a train step "
                                              "from a test step", when_missing="fallback",
    private=False)


def _distributed_iterator():
    import tensorflow as tf
    return tf.distribute.DistributedIterator


ITERATOR_NEXT = InstancePatch(
    "tf DistributedIterator.get_next_as_optional (per iterator)", GROUP, _distributed_iterator,
    "get_next_as_optional", "tf.distribute.DistributedIterator",
    changes="remembers the batches a step took eagerly, so that a retrace with the barrier "
            "runs the same batch", why="Keras 3.16 takes a step's batch before the traced "
                                       "step, which a failed trace would skip",
    when_missing="fallback", private=False)


def missing() -> dict:
    """{entry: why} of this group's moved targets (located now)."""
    return registry.install(GROUP)
