"""Keras 3 behaviour that BytePSStrategy adjusts: XLA, predict, checkpoint callbacks.

Keras 3 knows nothing of multi-worker jobs outside TensorFlow's own
MultiWorkerMirroredStrategy, so under BytePSStrategy with several workers:

* ``ModelCheckpoint`` and ``BackupAndRestore`` would have every worker write
  the same files at once (HDF5 refuses the second writer; on a shared file
  system files get torn). Rank 0 writes the real files; the other workers
  save into a private temporary directory that is deleted right away --
  they still run the save, so any reduction a save might trigger happens on
  every worker, and no worker blocks waiting for another;
* ``BackupAndRestore`` restores on rank 0 and sends the restored weights,
  optimizer state and epoch to the others, so a worker that cannot see the
  backup directory resumes too;
* ``jit_compile`` reads False: the push_pull op has no XLA kernel;
* ``predict(x)`` returns the predictions of all of ``x`` on every worker
  (Keras would return each worker's shard of every batch);
* in ``mode="async"``: ``fit`` starts from rank 0's weights and ends with a
  pull (bps_tf.comm.async_training); ``evaluate`` and ``predict`` run on this
  worker alone over all of ``x``, with the weights it last pulled.

``install(is_ours)`` wraps these methods once (``bps_tf.keras`` and
BytePSStrategy call it). ``is_ours(strategy)`` is a predicate telling a
BytePSStrategy (this module does not import the strategy). Each wrapper calls
the original unchanged unless the model's strategy satisfies a registered
predicate (and, for checkpoints, has more than one worker).
"""
from __future__ import annotations

import functools
import inspect
import os
import shutil
import tempfile
import threading
import warnings

import tensorflow as tf

from bps_tf.comm import async_training, collectives, naming
from bps_tf.horovod import api, optimizer_variables
from bps_tf.runtime import basics, config
from bps_tf.strategy import epoch_length, loss_scale, predictions

_installed = False
_lock = threading.Lock()
# Predicates telling a BytePSStrategy (registered by install()).
_is_ours = []


def is_bps_strategy(strategy) -> bool:
    """Whether ``strategy`` is a BytePSStrategy (by the registered predicates)."""
    return strategy is not None and any(pred(strategy) for pred in _is_ours)


def _bps_strategy(model):
    """The model's BytePSStrategy, or None."""
    strategy = getattr(model, "_distribute_strategy", None)
    return strategy if is_bps_strategy(strategy) else None


def _async(model):
    """The model's BytePSStrategy in mode="async", or None."""
    strategy = _bps_strategy(model)
    return strategy if getattr(strategy, "mode", "sync") == "async" else None


def _multi_worker(model):
    strategy = _bps_strategy(model)
    return strategy if strategy is not None and strategy.num_workers > 1 else None


# --------------------------------------------------------------------------
# jit_compile
# --------------------------------------------------------------------------
def _patch_jit_compile(trainer_cls):
    original = trainer_cls.jit_compile

    def jit_compile(self):
        value = original.fget(self)
        if value and _bps_strategy(self) is not None:
            warnings.warn("BytePSStrategy: jit_compile=True is turned off (the push_pull op "
                          "cannot be compiled by XLA).", stacklevel=2)
            self._jit_compile = False  # pylint: disable=protected-access
            return False
        return value

    trainer_cls.jit_compile = property(jit_compile, original.fset, original.fdel,
                                       original.__doc__)


def _patch_compile(trainer_cls):
    """Horovod's Keras examples and docs pass ``experimental_run_tf_function=
    False`` to ``compile``; Keras 2 ignored it under TF2, Keras 3 raises on
    it. Dropped, so those scripts run with one import changed."""
    original = trainer_cls.compile

    @functools.wraps(original)
    def compile(self, *args, experimental_run_tf_function=None, **kwargs):  # noqa: A001
        del experimental_run_tf_function
        return original(self, *args, **kwargs)

    trainer_cls.compile = compile


# --------------------------------------------------------------------------
# predict
# --------------------------------------------------------------------------
def _patch_predict(trainer_cls):
    """``model.predict(x)`` under a multi-worker BytePSStrategy returns every
    row of ``x``, in order, on every worker (bps_tf.strategy.predictions), unless the
    strategy was made with ``predict="shard"``. Inputs that cannot be split
    by rows (datasets, generators) or a ``steps`` limit keep Keras' per-shard
    behaviour, with a warning."""
    original = trainer_cls.predict

    @functools.wraps(original)
    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        if _async(self) is not None:
            # Nothing to gather: every worker predicts all of x itself.
            with _async(self).extended.local_input():
                return original(self, x, batch_size=batch_size, verbose=verbose, steps=steps,
                                callbacks=callbacks)
        strategy = _multi_worker(self)
        if strategy is None or getattr(strategy, "predict_mode", "all") != "all":
            return original(self, x, batch_size=batch_size, verbose=verbose, steps=steps,
                            callbacks=callbacks)
        if steps is not None or not predictions.is_row_data(x):
            warnings.warn("BytePSStrategy: model.predict on a dataset, a generator or with "
                          "steps= returns this worker's shard only; pass arrays (or use "
                          "bps_tf.gather_predictions) for every row.", stacklevel=2)
            return original(self, x, batch_size=batch_size, verbose=verbose, steps=steps,
                            callbacks=callbacks)
        if callbacks:
            warnings.warn("BytePSStrategy: model.predict(x) gathers the predictions of every "
                          "worker; callbacks are not called.", stacklevel=2)
        return predictions.gather_predictions(self, x, batch_size=batch_size)

    trainer_cls.predict = predict


# --------------------------------------------------------------------------
# Asynchronous mode: fit starts from rank 0's weights; evaluate is local
# --------------------------------------------------------------------------
class _StartAndPull:
    """Added to ``fit`` under mode="async": the store starts from rank 0's
    weights at train begin (the one synchronisation), and at train end this
    worker pulls the latest weights (no waiting for the others)."""

    def __init__(self, model):
        self._model = model

    def on_train_begin(self, logs=None):
        async_training.start_from_root(self._model.trainable_variables)

    def on_train_end(self, logs=None):
        async_training.pull(self._model.trainable_variables)


def _shard_rows(arguments, rank: int, size: int) -> None:
    """Worker ``rank`` of ``size`` keeps rows rank, rank+size, ... of the
    arrays ``fit`` was given (x, y, sample_weight); datasets and generators
    are left whole (docs/strategy.md: shard them yourself)."""
    x = arguments.get("x")
    if size == 1 or not predictions.is_row_data(x):
        return
    rows = len(tf.nest.flatten(x)[0])
    for name in ("x", "y", "sample_weight"):
        value = arguments.get(name)
        if value is not None and predictions.is_row_data(value) and \
                len(tf.nest.flatten(value)[0]) == rows:
            arguments[name] = tf.nest.map_structure(lambda a: a[rank::size], value)


def _patch_async_fit(trainer_cls):
    original = trainer_cls.fit
    signature = inspect.signature(original)

    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        strategy = _async(self)
        if strategy is None:
            return original(self, *args, **kwargs)
        import keras
        hooks = _StartAndPull(self)
        callback = keras.callbacks.LambdaCallback(on_train_begin=hooks.on_train_begin,
                                                  on_train_end=hooks.on_train_end)
        bound = signature.bind(self, *args, **kwargs)
        # Last: weights a user callback restores at train begin (BackupAndRestore)
        # are the ones rank 0 writes into the store.
        bound.arguments["callbacks"] = list(bound.arguments.get("callbacks") or []) + [callback]
        _shard_rows(bound.arguments, strategy.rank, strategy.num_workers)
        # Sharded here, not by tf.data: Keras counts the steps of an epoch
        # from the arrays it is given, and each worker runs its own epochs.
        with strategy.extended.local_input():
            return original(*bound.args, **bound.kwargs)

    trainer_cls.fit = fit


def _patch_optimizer_apply(optimizer_cls):
    original = optimizer_cls.apply

    @functools.wraps(original)
    def apply(self, *args, **kwargs):
        with async_training.optimizer_step():
            return original(self, *args, **kwargs)

    optimizer_cls.apply = apply


def _patch_loss_scale(loss_scale_cls):
    original = loss_scale_cls.check_finite

    @functools.wraps(original)
    def check_finite(self, grads):
        return loss_scale.agreed_finite(self, original(self, grads), is_bps_strategy)

    loss_scale_cls.check_finite = check_finite


def _patch_epoch_length(iterator_cls):
    original_init, original_reset = iterator_cls.__init__, iterator_cls.reset

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self._bps_unsized = epoch_length.unsized(self, is_bps_strategy)
        if self._bps_unsized:
            self._num_batches = None

    @functools.wraps(original_reset)
    def reset(self):
        original_reset(self)
        if self._bps_unsized:
            self._num_batches = None   # reset() reads the local count again

    iterator_cls.__init__, iterator_cls.reset = __init__, reset


def _patch_async_evaluate(trainer_cls):
    original = trainer_cls.evaluate

    @functools.wraps(original)
    def evaluate(self, *args, **kwargs):
        strategy = _async(self)
        if strategy is None:
            return original(self, *args, **kwargs)
        with strategy.extended.local_input():
            return original(self, *args, **kwargs)

    trainer_cls.evaluate = evaluate


# --------------------------------------------------------------------------
# Progress bar
# --------------------------------------------------------------------------
def _patch_progress_bar(progbar_cls):
    """Only rank 0 draws Keras' progress bar (N identical bars interleave)."""
    original = progbar_cls.set_params

    def set_params(self, params):
        original(self, params)
        if (basics.is_initialized() and basics.size() > 1 and basics.rank() != 0
                and not config.value("BYTEPS_PROGRESS_ALL_RANKS")):
            self.verbose = 0

    progbar_cls.set_params = set_params


# --------------------------------------------------------------------------
# Checkpoint callbacks
# --------------------------------------------------------------------------
class _PrivateDir:
    """Points some attributes of a callback into a temporary directory for
    the duration of a save, then restores them and deletes the directory."""

    def __init__(self, callback, rank: int, redirect):
        self._callback = callback
        self._dir = tempfile.mkdtemp(prefix=f"bps_tf_rank{rank}_")
        self._saved = {}
        self._redirect = redirect

    def __enter__(self):
        for attr, value in self._redirect(self._callback, self._dir).items():
            self._saved[attr] = getattr(self._callback, attr)
            setattr(self._callback, attr, value)
        return self._dir

    def __exit__(self, *exc):
        for attr, value in self._saved.items():
            setattr(self._callback, attr, value)
        shutil.rmtree(self._dir, ignore_errors=True)
        return False


def _backup_paths(callback, directory):
    paths = {"backup_dir": directory}
    for attr in ("_weights_path", "_training_metadata_path", "_prev_weights_path",
                 "_prev_training_metadata_path"):
        if hasattr(callback, attr):
            paths[attr] = os.path.join(directory, os.path.basename(getattr(callback, attr)))
    return paths


def _checkpoint_paths(callback, directory):
    return {"filepath": os.path.join(directory, os.path.basename(callback.filepath))}


def _save_on_rank0(original, redirect):
    @functools.wraps(original)
    def save(self, *args, **kwargs):
        strategy = _multi_worker(self.model)
        if strategy is None or strategy.rank == 0:
            return original(self, *args, **kwargs)
        with _PrivateDir(self, strategy.rank, redirect):
            return original(self, *args, **kwargs)
    return save


def _restore_from_rank0(original):
    @functools.wraps(original)
    def on_train_begin(self, logs=None):
        strategy = _multi_worker(self.model)
        if strategy is None:
            return original(self, logs)
        from keras.src.utils import file_utils
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
                original(self, logs)
                # After the original: it may have fallen back to the .bkp copy.
                state["restored"] = bool(file_utils.exists(self._weights_path))
                state["epoch"] = getattr(model, "_initial_epoch", None)
            except Exception as exc:  # pylint: disable=broad-except
                state["error"] = f"{type(exc).__name__}: {exc}"
        state = api.broadcast_object(state, root_rank=0,
                                     name=naming.strategy_key("backup", "state"))
        if state["error"]:
            raise RuntimeError(f"BackupAndRestore failed on rank 0: {state['error']}")
        if state["restored"]:
            broadcast_model_state(model)
        model._initial_epoch = state["epoch"]  # pylint: disable=protected-access
    return on_train_begin


def _cleanup_on_rank0(original):
    @functools.wraps(original)
    def on_train_end(self, logs=None):
        strategy = _multi_worker(self.model)
        if strategy is None or strategy.rank == 0:
            return original(self, logs)
        return None
    return on_train_end


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


# --------------------------------------------------------------------------
# Variable labels
# --------------------------------------------------------------------------
def _patch_variable_path(variable_cls):
    """Keras 3 may create a variable's TensorFlow variable after the layer's
    name scope is gone (deferred building), so its TensorFlow name is only
    ``kernel``; the Keras path is known here, and errors and the timeline
    show it (naming.display_path)."""
    original = variable_cls._initialize  # pylint: disable=protected-access

    @functools.wraps(original)
    def _initialize(self, value):
        with naming.creating_variable(getattr(self, "path", None)):
            return original(self, value)

    variable_cls._initialize = _initialize  # pylint: disable=protected-access


def give_tf_keras_a_version() -> None:
    """Under ``TF_USE_LEGACY_KERAS=1``, TensorFlow 2.16+'s ``tf.keras`` (a lazy
    loader for tf_keras) has no ``__version__``, which Keras-2-era scripts
    read to choose their optimizer API (Horovod's Keras tests do, e.g.
    ``version.parse(tf.keras.__version__) < "2.11"``). It gets tf_keras'
    version; nothing else of TensorFlow's namespace changes."""
    if not config.tf_keras_enabled():
        return
    import tensorflow as tf
    if getattr(tf.keras, "__version__", None) is None:
        import tf_keras
        tf.keras.__version__ = tf_keras.__version__


def install(is_ours=None) -> None:
    """Wraps the Keras methods above (once per process); ``is_ours(strategy)``,
    if given, is added to the predicates telling a BytePSStrategy."""
    global _installed
    with _lock:
        if is_ours is not None and is_ours not in _is_ours:
            _is_ours.append(is_ours)
        if _installed:
            return
        import keras
        from keras.src.trainers import trainer as trainer_module
        _patch_jit_compile(trainer_module.Trainer)
        _patch_compile(trainer_module.Trainer)
        from keras.src.backend.tensorflow import trainer as tf_trainer_module
        _patch_predict(tf_trainer_module.TensorFlowTrainer)
        _patch_async_fit(tf_trainer_module.TensorFlowTrainer)
        _patch_async_evaluate(tf_trainer_module.TensorFlowTrainer)
        _patch_epoch_length(tf_trainer_module.TFEpochIterator)
        from keras.src.optimizers import base_optimizer, loss_scale_optimizer
        _patch_optimizer_apply(base_optimizer.BaseOptimizer)
        _patch_loss_scale(loss_scale_optimizer.LossScaleOptimizer)
        optimizer_variables.install()
        from keras.src.backend.tensorflow import core as tf_core_module
        _patch_variable_path(tf_core_module.Variable)
        _patch_progress_bar(keras.callbacks.ProgbarLogger)
        backup = keras.callbacks.BackupAndRestore
        backup.on_train_begin = _restore_from_rank0(backup.on_train_begin)
        backup._save_model = _save_on_rank0(backup._save_model, _backup_paths)  # pylint: disable=protected-access
        backup.on_train_end = _cleanup_on_rank0(backup.on_train_end)
        checkpoint = keras.callbacks.ModelCheckpoint
        checkpoint._save_model = _save_on_rank0(checkpoint._save_model, _checkpoint_paths)  # pylint: disable=protected-access
        _installed = True
