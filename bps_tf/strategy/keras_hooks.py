"""Keras 3 behaviour that BytePSStrategy adjusts, declared in the hook registry.

Each hook acts only for a model whose ``distribute_strategy`` is a
BytePSStrategy (bps_tf.strategy.identity) and calls the original otherwise:

* ``jit_compile`` reads False: the push_pull op has no XLA kernel;
* ``predict(x)`` returns the predictions of all of ``x`` on every worker
  (Keras would return each worker's shard of every batch);
* the epoch of ``fit``/``evaluate`` has the same number of steps on every
  worker (bps_tf.strategy.epoch_length);
* the mixed-precision inf/nan check is agreed across workers
  (bps_tf.strategy.loss_scale);
* an optimizer's own variables keep their aggregation (bps_tf.strategy.extended);
* in ``mode="async"``: ``fit`` starts from rank 0's weights and ends with a
  pull (bps_tf.comm.async_training); ``evaluate`` and ``predict`` run on this
  worker alone over all of ``x``, with the weights it last pulled;
* only rank 0 draws the progress bar; variables' Keras paths label their
  push_pulls in errors and the timeline;
* the checkpoint callbacks: bps_tf.strategy.checkpoint_hooks.

Every target is a public Keras name except the epoch iterator (found by
role: bps_tf.runtime.hooks.epoch_iterator_class) and the variable's
``_initialize`` (the class of ``keras.Variable``'s MRO that defines it).
"""
from __future__ import annotations

import functools
import inspect
import threading
import warnings

import tensorflow as tf

from bps_tf.comm import async_training, fingerprint, naming
from bps_tf.comm import optimizer_variables
from bps_tf.overlap import fit as overlap_fit
from bps_tf.runtime import basics, config, hooks
from bps_tf.strategy import batch_share  # noqa: F401  (declares the batch-share hooks)
from bps_tf.strategy import checkpoint_hooks  # noqa: F401  (declares the callbacks' hooks)
from bps_tf.strategy import epoch_length, loss_scale, phases, predictions
from bps_tf.strategy.identity import async_mode, is_bps_strategy, multi_worker, of_model

GROUP = "keras"
_NO_CONTRACT = "tf.distribute has no say in this; Keras only special-cases its own strategies"
_state = threading.local()


def _register(target, changes, why, when_missing="error", locate=None, private=False,
              found_by=""):
    owner, _, attr = target.rpartition(".")
    return hooks.register(target, GROUP, locate or hooks.attribute_of(owner, attr),
                          changes=changes, why=why, when_missing=when_missing, private=private,
                          found_by=found_by)


@_register("keras.Model.jit_compile",
           "reads False under BytePSStrategy (warning if it was True)",
           "the push_pull op has no XLA kernel; compile(jit_compile='auto') would pick XLA "
           "on a GPU")
def _jit_compile(original):
    def jit_compile(self):
        value = original.fget(self)
        if value and of_model(self) is not None:
            warnings.warn("BytePSStrategy: jit_compile=True is turned off (the push_pull op "
                          "cannot be compiled by XLA).", stacklevel=2)
            original.fset(self, False)
            return False
        return value
    return property(jit_compile, original.fset, original.fdel, original.__doc__)


@_register("keras.Model.compile",
           "drops experimental_run_tf_function= (Horovod's Keras examples pass it)",
           "Keras 3 raises on the argument Keras 2 ignored", when_missing="cosmetic",
           # Wrapped where it is defined: Keras compiles a loaded model only if
           # type(model).compile is still its own base trainer's.
           locate=hooks.attribute_of("keras.Model", "compile", defined_by_role=True))
def _compile(original):
    @functools.wraps(original)
    def compile(self, *args, experimental_run_tf_function=None, **kwargs):  # noqa: A001
        del experimental_run_tf_function
        return original(self, *args, **kwargs)
    return compile


@_register("keras.Model.predict",
           "every row of x on every worker (bps_tf.strategy.predictions); async: this "
           "worker alone; pending overlapped updates applied first",
           "Keras gathers predictions across workers only for its own multi-worker strategy; "
           "the contract's experimental_local_results serves training logs too")
def _predict(original):
    @functools.wraps(original)
    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        args = dict(batch_size=batch_size, verbose=verbose, steps=steps, callbacks=callbacks)
        elastic = of_model(self)
        if getattr(elastic, "elastic", False):
            from bps_tf.strategy import elastic_calls
            gathered = (steps is None and predictions.is_row_data(x)
                        and getattr(elastic, "predict_mode", "all") == "all")
            return elastic_calls.run(elastic_calls.PREDICT, self, elastic,
                                     lambda: _predict_once(original, self, x, args),
                                     keep=gathered)
        return _predict_once(original, self, x, args)
    return predict


def _predict_once(original, model, x, args):
    overlap_fit.flush_model(model)
    phases.boundary(multi_worker(model), phases.PREDICT, args["steps"])
    strategy = async_mode(model)
    if strategy is not None:
        # Nothing to gather: every worker predicts all of x itself.
        with strategy.extended.local_input():
            return original(model, x, **args)
    strategy = multi_worker(model)
    if strategy is None or getattr(strategy, "predict_mode", "all") != "all":
        return original(model, x, **args)
    if args["steps"] is not None or not predictions.is_row_data(x):
        warnings.warn("BytePSStrategy: model.predict on a dataset, a generator or with "
                      "steps= returns this worker's shard only; pass arrays (or use "
                      "bps_tf.gather_predictions) for every row.", stacklevel=3)
        return original(model, x, **args)
    if args["callbacks"]:
        warnings.warn("BytePSStrategy: model.predict(x) gathers the predictions of every "
                      "worker; callbacks are not called.", stacklevel=3)
    return predictions.gather_predictions(model, x, batch_size=args["batch_size"])


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


class _DriftCheck:
    """Added to ``fit`` under a multi-worker BytePSStrategy: every
    BYTEPS_FINGERPRINT_STEPS batches of the call, between two steps, the
    workers compare the fingerprints of the model's variables
    (bps_tf.comm.fingerprint). Batches are counted here, not read from
    ``optimizer.iterations``: every worker counts the same, and the count
    never depends on another thread (the overlap swaps the optimizer's
    iteration variable while it traces a deferred update)."""

    def __init__(self, model):
        self._model = model
        self._batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self._batches % fingerprint.every():
            return
        overlap_fit.flush_model(self._model)
        # Floating variables: weights, moving statistics, optimizer slots
        # (random generators' states may differ by design).
        variables = [v for v in naming.model_variables(self._model, skip_on_read=True)
                     if tf.as_dtype(v.dtype).is_floating]
        fingerprint.check_now(variables, naming.strategy_key("fit", "weights"),
                              f"model.fit, batch {self._batches} of this fit")


@_register("keras.Model.fit",
           "async: starts from rank 0's weights, ends with a pull, each worker on its rows",
           "an asynchronous worker trains alone; no tf.distribute call marks fit's start/end")
def _fit(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        elastic = of_model(self)
        if getattr(elastic, "elastic", False):
            return _elastic_fit(original, signature, self, elastic, args, kwargs)
        strategy = async_mode(self)
        if strategy is None:
            strategy = multi_worker(self)
            if strategy is None:
                return original(self, *args, **kwargs)
            bound = signature.bind(self, *args, **kwargs)
            given = dict(bound.arguments)
            bound.apply_defaults()
            arguments = bound.arguments
            phases.boundary(strategy, phases.FIT, arguments.get("epochs"),
                            arguments.get("initial_epoch"), arguments.get("steps_per_epoch"))
            callbacks = given.get("callbacks")
            if callbacks is None or isinstance(callbacks, (list, tuple)):
                import keras
                checks = phases.PhaseCallback(strategy, int(arguments.get("epochs") or 1))
                checks.model = self
                extra = [keras.callbacks.LambdaCallback(on_epoch_end=checks.on_epoch_end)]
                if fingerprint.every() > 0:
                    drift = _DriftCheck(self)
                    extra.append(keras.callbacks.LambdaCallback(
                        on_train_batch_end=drift.on_train_batch_end))
                arguments["callbacks"] = list(callbacks or []) + extra
            return original(*bound.args, **bound.kwargs)
        import keras
        ends = _StartAndPull(self)
        callback = keras.callbacks.LambdaCallback(on_train_begin=ends.on_train_begin,
                                                  on_train_end=ends.on_train_end)
        bound = signature.bind(self, *args, **kwargs)
        # Last: weights a user callback restores at train begin (BackupAndRestore)
        # are the ones rank 0 writes into the store.
        bound.arguments["callbacks"] = list(bound.arguments.get("callbacks") or []) + [callback]
        _shard_rows(bound.arguments, strategy.rank, strategy.num_workers)
        # Sharded here, not by tf.data: Keras counts the steps of an epoch
        # from the arrays it is given, and each worker runs its own epochs.
        with strategy.extended.local_input():
            return original(*bound.args, **bound.kwargs)
    return fit


def _elastic_fit(original, signature, model, strategy, args, kwargs):
    """An elastic strategy's fit: the phase checks of every attempt, inside
    the elastic loop (elastic_fit.py), from the epoch the state says."""
    import keras
    from bps_tf.strategy import elastic_fit
    bound = signature.bind(model, *args, **kwargs)
    given = dict(bound.arguments)
    bound.apply_defaults()
    user_callbacks = given.get("callbacks")
    if user_callbacks is not None and not isinstance(user_callbacks, (list, tuple)):
        raise ValueError("BytePSStrategy(elastic=True): fit(callbacks=...) must be a list "
                         "(the elastic commit joins it).")

    def start(initial_epoch, first, last):
        arguments = dict(bound.arguments)
        arguments["initial_epoch"] = initial_epoch
        epochs = int(arguments.get("epochs") or 1)
        phases.boundary(strategy, phases.FIT, epochs, initial_epoch,
                        arguments.get("steps_per_epoch"))
        checks = phases.PhaseCallback(strategy, epochs)
        checks.model = model
        added = [keras.callbacks.LambdaCallback(on_epoch_end=checks.on_epoch_end)]
        if fingerprint.every() > 0 and basics.size() > 1:
            drift = _DriftCheck(model)
            added.append(keras.callbacks.LambdaCallback(
                on_train_batch_end=drift.on_train_batch_end))
        # The commit first: an epoch's commit is taken before any callback of
        # the next epoch runs (one that raises must not leave it uncommitted).
        arguments["callbacks"] = list(first) + list(user_callbacks or []) + list(last) + added
        del arguments["self"]
        return original(model, **arguments)

    return elastic_fit.run_fit(model, strategy, bound.arguments, start)


@_register("keras.Model.evaluate",
           "pending overlapped updates applied first; async: this worker alone over all of x",
           "evaluate reads the weights; no tf.distribute call comes before its first read")
def _evaluate(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def evaluate(self, *args, **kwargs):
        elastic = of_model(self)
        if getattr(elastic, "elastic", False):
            from bps_tf.strategy import elastic_calls
            return elastic_calls.run(elastic_calls.EVALUATE, self, elastic,
                                     lambda: _evaluate_once(original, signature, self, args,
                                                            kwargs))
        return _evaluate_once(original, signature, self, args, kwargs)
    return evaluate


def _evaluate_once(original, signature, model, args, kwargs):
    overlap_fit.flush_model(model)
    strategy = multi_worker(model)
    if strategy is not None:
        phases.boundary(strategy, phases.EVALUATE,
                        signature.bind(model, *args, **kwargs).arguments.get("steps"))
    strategy = async_mode(model)
    if strategy is None:
        return original(model, *args, **kwargs)
    with strategy.extended.local_input():
        return original(model, *args, **kwargs)


_ITERATOR_ROLE = ("role: the EpochIterator subclass of the module of the class in "
                  "keras.Model's MRO that defines make_train_function (TFEpochIterator)")
_ITERATOR_WHY = ("Keras sizes an epoch from this worker's data before tf.distribute sees it; "
                 "workers with different counts would wait for each other forever")


def _epoch_iterator_method(attr):
    return lambda: (hooks.defining_class(hooks.epoch_iterator_class(), attr), attr)


@_register("keras epoch iterator.__init__",
           "an epoch whose batch counts differ across workers runs until all are out of data",
           _ITERATOR_WHY, when_missing="fallback", locate=_epoch_iterator_method("__init__"),
           private=True, found_by=_ITERATOR_ROLE)
def _iterator_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self._bps_unsized = epoch_length.unsized(self, is_bps_strategy)
        if self._bps_unsized:
            self._num_batches = None
    return __init__


@_register("keras epoch iterator.reset",
           "keeps such an epoch unsized when Keras reads the local count again",
           _ITERATOR_WHY, when_missing="fallback", locate=_epoch_iterator_method("reset"),
           private=True, found_by=_ITERATOR_ROLE)
def _iterator_reset(original):
    @functools.wraps(original)
    def reset(self):
        original(self)
        if getattr(self, "_bps_unsized", False):
            self._num_batches = None
    return reset


@_register("keras.optimizers.Optimizer.apply",
           "async: marks the optimizer's own updates, which push their change",
           "a weight's update and any other assign reach the strategy the same way")
def _apply(original):
    @functools.wraps(original)
    def apply(self, *args, **kwargs):
        with async_training.optimizer_step():
            return original(self, *args, **kwargs)
    return apply


@_register("keras.optimizers.Optimizer.add_variable",
           "marks an optimizer creating its variables (the strategy leaves their "
           "aggregation alone)",
           "the strategy sees only the variable's kwargs, not that an optimizer creates it")
def _add_variable(original):
    @functools.wraps(original)
    def add_variable(self, *args, **kwargs):
        saved = getattr(_state, "optimizer", None)
        _state.optimizer = self
        try:
            return original(self, *args, **kwargs)
        finally:
            _state.optimizer = saved
    return add_variable


def optimizer_building():
    """The Keras optimizer creating a variable right now, or None."""
    return getattr(_state, "optimizer", None)


@_register("keras.optimizers.LossScaleOptimizer.check_finite",
           "the inf/nan check agreed across replicas and workers",
           "Keras checks each replica's gradients before they are summed and acts on that "
           "alone; a worker skipping a step alone would desynchronise the job")
def _check_finite(original):
    @functools.wraps(original)
    def check_finite(self, grads):
        return loss_scale.agreed_finite(self, original(self, grads), is_bps_strategy)
    return check_finite


@_register("keras.Variable._initialize",
           "the Keras path labels a variable's push_pulls in errors and the timeline",
           "Keras may create the TensorFlow variable after the layer's name scope is gone",
           when_missing="cosmetic", private=True,
           found_by="role: the class of keras.Variable's MRO that defines _initialize",
           locate=lambda: (hooks.defining_class(hooks.public("keras.Variable"), "_initialize"),
                           "_initialize"))
def _initialize(original):
    @functools.wraps(original)
    def _initialize(self, value):
        with naming.creating_variable(getattr(self, "path", None)):
            return original(self, value)
    return _initialize


@_register("keras.callbacks.ProgbarLogger.set_params",
           "only rank 0 draws the progress bar (BYTEPS_PROGRESS_ALL_RANKS=1: all)",
           "Keras draws one bar per process; N identical bars interleave",
           when_missing="cosmetic")
def _set_params(original):
    @functools.wraps(original)
    def set_params(self, params):
        original(self, params)
        if (basics.is_initialized() and basics.size() > 1 and basics.rank() != 0
                and not config.value("BYTEPS_PROGRESS_ALL_RANKS")):
            self.verbose = 0
    return set_params


def give_tf_keras_a_version() -> None:
    """Under ``TF_USE_LEGACY_KERAS=1``, TensorFlow 2.16+'s ``tf.keras`` (a lazy
    loader for tf_keras) has no ``__version__``, which Keras-2-era scripts
    read to choose their optimizer API (Horovod's Keras tests do, e.g.
    ``version.parse(tf.keras.__version__) < "2.11"``). It gets tf_keras'
    version; nothing else of TensorFlow's namespace changes."""
    if not config.tf_keras_enabled():
        return
    if getattr(tf.keras, "__version__", None) is None:
        import tf_keras
        tf.keras.__version__ = tf_keras.__version__


def install() -> None:
    """Installs the Keras hooks (once per process; bps_tf.keras and
    BytePSStrategy call it). A missing hook whose policy is "error" raises
    bps_tf.runtime.hooks.HookError here, naming it and the Keras version."""
    import keras  # noqa: F401  (the hooks' targets)
    hooks.check_keras_version()
    hooks.install(GROUP)
    hooks.install(optimizer_variables.GROUP)
    hooks.require(GROUP, "BytePSStrategy")
    hooks.warn_fallback(GROUP, "each epoch's step counts are checked to be equal on every "
                               "worker instead of being agreed (different counts raise)")
