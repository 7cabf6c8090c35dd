"""The state of ``fit``'s callbacks, committed with the model under
``BytePSStrategy(elastic=True)`` (docs/elastic.md).

After a membership change ``fit`` runs again from the committed epoch, and
Keras calls every callback's ``on_train_begin``: EarlyStopping would start
its patience again, ReduceLROnPlateau its wait and cooldown,
ModelCheckpoint(save_best_only=True) would keep its best value but count
batches afresh, BackupAndRestore would label its backups with a stale
epoch; a newcomer's callbacks would start from nothing. So the elastic fit
captures each callback's state at every commit (each epoch's start), and
puts the committed state back, on every worker (the root's, sent to all),
when the next attempt's first epoch begins -- after every ``on_train_begin``.

A callback's state is, in this order:

- what its ``get_elastic_state()`` returns (given back to its
  ``set_elastic_state(state)``), when it defines both;
- the attributes named by its ``elastic_state_attributes`` (a list of
  names);
- for the callbacks Keras ships, their counters and best values (``KERAS``
  below; the private ones are declared in the hook registry, and left out
  with one warning when a Keras release moves them);
- else nothing: the callback starts again as Keras starts it at each fit.

Values must pickle (a newcomer receives them); they are deep-copied.
"""
from __future__ import annotations

import copy
import logging
import tempfile

from bps_tf.hooks import registry as hooks

log = logging.getLogger("bps_tf")
GROUP = "elastic_callbacks"

# Keras callback -> its public attributes that hold state across epochs.
KERAS = {
    "keras.callbacks.EarlyStopping": ("wait", "stopped_epoch", "best", "best_weights",
                                      "best_epoch"),
    "keras.callbacks.ReduceLROnPlateau": ("wait", "cooldown_counter", "best"),
    "keras.callbacks.ModelCheckpoint": ("best",),
}
# ... and its private ones, each a registry entry (found on a fresh instance).
KERAS_PRIVATE = {
    "keras.callbacks.ModelCheckpoint": ("_batches_seen_since_last_saving", "_last_batch_seen"),
    "keras.callbacks.BackupAndRestore": ("_current_epoch", "_last_batch_seen",
                                         "_batches_seen_since_last_saving"),
    "keras.callbacks.TensorBoard": ("_global_train_batch",),
}


def _sample(class_path):
    """A fresh instance of a Keras callback (its attributes are set in
    ``__init__``), with harmless arguments; nothing is written."""
    cls = hooks.public(class_path)
    folder = tempfile.gettempdir()
    if class_path.endswith("ModelCheckpoint"):
        return cls(filepath=f"{folder}/bps_tf_probe.keras")
    if class_path.endswith("BackupAndRestore"):
        return cls(backup_dir=f"{folder}/bps_tf_probe_backup")
    if class_path.endswith("TensorBoard"):
        return cls(log_dir=f"{folder}/bps_tf_probe_logs")
    return cls()


def _probe(class_path, attr):
    def locate():
        sample = _sample(class_path)
        if not hasattr(sample, attr):
            raise hooks.HookMissing(f"a new {class_path} has no attribute {attr!r}")
        return sample, attr
    locate.found_by = f"an attribute of a new {class_path}"
    return locate


for _path, _attrs in KERAS_PRIVATE.items():
    for _attr in _attrs:
        hooks.probe(f"{_path}.{_attr}", GROUP, _probe(_path, _attr),
                    changes="committed and restored with the model by the elastic fit",
                    why="Keras keeps this counter in a private attribute that on_train_begin "
                        "or a new instance starts from zero; no API reads or sets it",
                    when_missing="fallback", private=True)


def install() -> None:
    """Checks the private attributes (once per process; one warning if a
    Keras release moved one: that callback's counter restarts after a
    membership change, as Keras' own would at each fit)."""
    hooks.install(GROUP)
    hooks.warn_fallback(GROUP, "the elastic fit commits these callbacks' other state only")


def _names(callback):
    names = getattr(callback, "elastic_state_attributes", None)
    if names is not None:
        return tuple(names)
    found = []
    for table, private in ((KERAS, False), (KERAS_PRIVATE, True)):
        for path, attrs in table.items():
            try:
                cls = hooks.public(path)
            except hooks.HookMissing:
                continue
            if isinstance(callback, cls):
                found += [a for a in attrs
                          if not private or hooks.is_installed(f"{path}.{a}")]
    return tuple(found)


def _custom(callback) -> bool:
    return callable(getattr(callback, "get_elastic_state", None)) and \
        callable(getattr(callback, "set_elastic_state", None))


def capture(callbacks) -> list:
    """Each callback's class name and state, in order (what a commit keeps)."""
    out = []
    for callback in callbacks:
        if _custom(callback):
            state = ("custom", copy.deepcopy(callback.get_elastic_state()))
        else:
            state = ("attributes", {name: copy.deepcopy(getattr(callback, name))
                                    for name in _names(callback) if hasattr(callback, name)})
        out.append((type(callback).__name__, state))
    return out


def restore(callbacks, captured) -> None:
    """Puts a capture back into ``callbacks`` (the same list on every
    worker: the same script)."""
    if captured is None:
        return
    mine = [type(c).__name__ for c in callbacks]
    theirs = [name for name, _ in captured]
    if mine != theirs:
        raise RuntimeError(
            f"BytePSStrategy(elastic=True): this worker's fit callbacks ({mine}) differ from the "
            f"committed ones ({theirs}); every worker must pass the same callbacks to fit.")
    for callback, (_, (kind, state)) in zip(callbacks, captured):
        state = copy.deepcopy(state)
        if kind == "custom":
            callback.set_elastic_state(state)
        else:
            for name, value in state.items():
                setattr(callback, name, value)
