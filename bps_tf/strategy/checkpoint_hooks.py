"""Keras' checkpoint callbacks across workers: rank 0 writes, every worker resumes.

Under a multi-worker ``BytePSStrategy``, ``ModelCheckpoint`` and
``BackupAndRestore`` would have every worker write the same files at once
(HDF5 refuses the second writer; on a shared file system files get torn).
Rank 0 writes the real files; the other workers save into a private
temporary directory that is deleted right away -- they still run the save,
so any reduction a save might trigger happens on every worker, and no worker
blocks waiting for another. ``BackupAndRestore`` restores on rank 0 and
sends the restored weights, optimizer state and epoch to the others, so a
worker that cannot see the backup directory resumes too.

The hooks wrap the callbacks' public methods (``on_epoch_end``,
``on_train_batch_end``, ``on_train_begin``, ``on_train_end``); the paths a
save writes to are found by value (every string attribute under the
callback's directory), not by Keras' private attribute names.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import tempfile
import weakref

import tensorflow as tf

from bps_tf.comm import collectives, naming
from bps_tf.comm import compression as compression_lib
from bps_tf.comm import exchange
from bps_tf.hooks import registry as hooks
from bps_tf.hooks.entries import PrivateAttribute
from bps_tf.hooks.roles import keras_class
from bps_tf.strategy.identity import multi_worker, of_model

log = logging.getLogger("bps_tf")
_warned: list = []
# Models whose elastic fit runs a resumed attempt (elastic_fit.py).
_resumed: "weakref.WeakSet" = weakref.WeakSet()

_WHY = ("Keras 3 callbacks write on every worker; only TensorFlow's own multi-worker "
        "strategy is special-cased, and no callback option names a writer")
_BACKUP = "BackupAndRestore under a multi-worker BytePSStrategy"
# Keras' BackupAndRestore hands the epoch it restored to fit this way.
INITIAL_EPOCH = PrivateAttribute(
    "keras.Model._initial_epoch", "keras", keras_class("keras.Model"), "_initial_epoch",
    ("__init__",), "keras.Model",
    changes="read on rank 0 after its restore, then set on every worker to the epoch rank 0 "
            "resumes from", why=_WHY + "; fit takes a restored epoch only from this attribute",
    when_missing="error", feature=_BACKUP)


class _PrivateDir:
    """Points the callback's paths under ``root`` into a temporary directory
    for the duration of a call, then restores them and deletes it."""

    def __init__(self, callback, rank: int, paths):
        self._callback = callback
        self._dir = tempfile.mkdtemp(prefix=f"bps_tf_rank{rank}_")
        self._paths = paths
        self._saved = {}

    def __enter__(self):
        for attr, value in self._paths(self._callback, self._dir).items():
            self._saved[attr] = getattr(self._callback, attr)
            setattr(self._callback, attr, value)
        return self._dir

    def __exit__(self, *exc):
        for attr, value in self._saved.items():
            setattr(self._callback, attr, value)
        shutil.rmtree(self._dir, ignore_errors=True)
        return False


def _backup_files(callback):
    """{attribute: path} of every string attribute of a BackupAndRestore
    under its ``backup_dir`` (the weights and metadata files, and their
    previous copies, whatever Keras calls them)."""
    root = os.fspath(callback.backup_dir).rstrip(os.sep)
    return {attr: value for attr, value in vars(callback).items()
            if attr != "backup_dir" and isinstance(value, str)
            and value.startswith(root + os.sep)}


def _backup_paths(callback, directory):
    """The paths of a BackupAndRestore moved under ``directory``."""
    root = os.fspath(callback.backup_dir)
    paths = {attr: os.path.join(directory, os.path.relpath(value, root))
             for attr, value in _backup_files(callback).items()}
    paths["backup_dir"] = directory
    return paths


def _checkpoint_paths(callback, directory):
    return {"filepath": os.path.join(directory, os.path.basename(os.fspath(callback.filepath)))}


def _saves_on_rank0(paths):
    """A wrapper of a callback method that may save: on ranks other than 0
    it saves into a private directory."""
    def wrap(original):
        @functools.wraps(original)
        def method(self, *args, **kwargs):
            strategy = multi_worker(self.model)
            if strategy is None or strategy.rank == 0:
                return original(self, *args, **kwargs)
            with _PrivateDir(self, strategy.rank, paths):
                return original(self, *args, **kwargs)
        return method
    return wrap


def _register_saves(owner: str, paths, methods) -> None:
    for name in methods:
        hooks.register(
            f"{owner}.{name}", "keras", hooks.attribute_of(owner, name),
            changes="rank 0 writes the files; other workers save into a private temporary "
                    "directory (multi-worker BytePSStrategy only)",
            why=_WHY, when_missing="error")(_saves_on_rank0(paths))


_register_saves("keras.callbacks.ModelCheckpoint", _checkpoint_paths,
                ("on_epoch_end", "on_train_batch_end"))
_register_saves("keras.callbacks.BackupAndRestore", _backup_paths,
                ("on_epoch_end", "on_train_batch_end"))


@hooks.register("keras.callbacks.BackupAndRestore.on_train_begin", "keras",
                hooks.attribute_of("keras.callbacks.BackupAndRestore", "on_train_begin"),
                changes="restores on rank 0 and sends the weights, optimizer state and epoch "
                        "to every worker",
                why=_WHY + "; a worker may not see rank 0's backup directory",
                when_missing="error")
def _restore_from_rank0(original):
    @functools.wraps(original)
    def on_train_begin(self, logs=None):
        if self.model in _resumed:
            return None   # the elastic commit is newer than any backup (resuming())
        if any(tf.io.gfile.exists(path) for path in _backup_files(self).values()):
            _warn_if_compression_restarts(self.model)
        strategy = multi_worker(self.model)
        if strategy is None:
            return original(self, logs)
        INITIAL_EPOCH.require(_BACKUP)     # on every worker, before anything collective
        model = self.model
        optimizer = getattr(model, "optimizer", None)
        # Creating variables is collective (their initial values come from
        # rank 0): build the optimizer on every worker, not only where the
        # backup is loaded.
        if model.built and optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
        state = {"error": None, "restored": False, "epoch": None}
        if strategy.rank == 0:
            try:
                # A backup exists when one of its files does (Keras falls back
                # to the previous copy itself).
                state["restored"] = any(tf.io.gfile.exists(path)
                                        for path in _backup_files(self).values())
                original(self, logs)
                state["epoch"] = INITIAL_EPOCH.get(model, feature=_BACKUP)
            except Exception as exc:  # pylint: disable=broad-except
                state["error"] = f"{type(exc).__name__}: {exc}"
        state = exchange.broadcast_object(state, root_rank=0,
                                     name=naming.strategy_key("backup", "state"))
        if state["error"]:
            raise RuntimeError(f"BackupAndRestore failed on rank 0: {state['error']}")
        if state["restored"]:
            broadcast_model_state(model)
        INITIAL_EPOCH.set(model, state["epoch"], feature=_BACKUP)
    return on_train_begin


@hooks.register("keras.callbacks.BackupAndRestore.on_train_end", "keras",
                hooks.attribute_of("keras.callbacks.BackupAndRestore", "on_train_end"),
                changes="only rank 0 deletes the backup at the end of training",
                why=_WHY, when_missing="error")
def _cleanup_on_rank0(original):
    @functools.wraps(original)
    def on_train_end(self, logs=None):
        strategy = multi_worker(self.model)
        if strategy is None or strategy.rank == 0:
            return original(self, logs)
        return None
    return on_train_end


@contextlib.contextmanager
def resuming(model, resumed: bool):
    """An elastic fit's attempt. A *resumed* one (after a membership change,
    or a newcomer joining a fit under way) goes on from the elastic commit:
    BackupAndRestore loads nothing (its backup may be older than the commit:
    with ``save_freq=<int>`` it is labelled with the epoch in progress), and
    the epoch a backup restored earlier in this fit (Keras keeps it on the
    model for every later fit) gives way to the committed one."""
    if not resumed:
        yield
        return
    model._initial_epoch = None  # pylint: disable=protected-access
    _resumed.add(model)
    try:
        yield
    finally:
        _resumed.discard(model)


def _warn_if_compression_restarts(model) -> None:
    """A resumed run whose compressor keeps state (error feedback, momentum,
    a random stream) starts that state afresh: say so once."""
    strategy = of_model(model)
    compression = getattr(strategy, "compression", None) if strategy is not None else \
        getattr(getattr(model, "optimizer", None), "_bps_compression", None)
    if not compression_lib.keeps_state(compression) or _warned:
        return
    _warned.append(True)
    log.warning("bps_tf: resuming from a backup with %r: its error-feedback residuals, momentum "
                "and random stream live in the engine, not in the checkpoint, and start again "
                "from zero, so the resumed run is not bit-identical to an uninterrupted one "
                "(docs/compression.md#resuming-from-a-checkpoint).", compression)


def broadcast_model_state(model, root_rank: int = 0) -> None:
    """Gives every worker ``root_rank``'s model and optimizer variables.

    Variables are matched by position (every worker built the same model),
    not by name: Keras numbers layer names per process. Metric variables
    (per-replica partial sums) are left alone.
    """
    variables = naming.model_variables(model, skip_on_read=True)

    @tf.function(autograph=False)
    def assign_all():
        for i, v in enumerate(variables):
            v.assign(collectives.broadcast(tf.convert_to_tensor(v),
                                           naming.strategy_key("state", i), root_rank))
    if variables:
        assign_all()
