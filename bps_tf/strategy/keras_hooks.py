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
* the replica fingerprint between steps and at the end of ``fit``
  (bps_tf.strategy.drift_check);
* the checkpoint callbacks: bps_tf.strategy.checkpoint_hooks.

Every target here is a public Keras name; the epoch iterator's (found by
role) are in bps_tf.strategy.epoch_length, and what the Horovod Keras face
shares (progress bar, ``compile``'s Keras 2 argument, variable labels) in
bps_tf.hooks.keras_shared.
"""
from __future__ import annotations

import functools
import inspect
import threading
import warnings

import tensorflow as tf

from bps_tf.comm import async_training, optimizer_variables
from bps_tf.hooks import keras_shared
from bps_tf.hooks import registry as hooks
from bps_tf.hooks import tf_internals  # noqa: F401  (declares the strategy's TF internals)
from bps_tf.overlap import fit as overlap_fit
from bps_tf.runtime import basics
from bps_tf.strategy import batch_share  # noqa: F401  (declares the batch-share hooks)
from bps_tf.strategy import checkpoint_hooks  # noqa: F401  (declares the callbacks' hooks)
from bps_tf.strategy import drift_check, epoch_length, loss_scale, phases, predictions
from bps_tf.strategy.identity import async_mode, is_bps_strategy, multi_worker, of_model

GROUP = "keras"
_NO_CONTRACT = "tf.distribute has no say in this; Keras only special-cases its own strategies"
_state = threading.local()
CHECK_FINITE = "keras.optimizers.LossScaleOptimizer.check_finite"


def _register(target, changes, why, when_missing="error", locate=None, private=False,
              found_by="", feature=""):
    owner, _, attr = target.rpartition(".")
    return hooks.register(target, GROUP, locate or hooks.attribute_of(owner, attr),
                          changes=changes, why=why, when_missing=when_missing, private=private,
                          found_by=found_by, feature=feature)


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
                extra += _counts_checks(arguments)
                extra += drift_check.callbacks(self)
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


def _counts_checks(arguments) -> list:
    """Without the epoch iterator's hooks (a Keras that moved them): the
    workers' batch counts of fit's data and validation data compared before
    the first step (bps_tf.strategy.epoch_length.check_counts)."""
    if epoch_length.sized_by_hooks():
        return []
    import keras
    checks = []
    if arguments.get("steps_per_epoch") is None:
        checks.append(lambda params: epoch_length.check_counts(params.get("steps"), "fit"))
    validation = arguments.get("validation_data")
    if arguments.get("validation_steps") is None and (validation is not None or
                                                      arguments.get("validation_split")):
        batch = arguments.get("validation_batch_size") or arguments.get("batch_size")
        if validation is not None:
            x = validation[0] if isinstance(validation, (tuple, list)) else validation
            count = epoch_length.batches_of(x, batch)
        else:
            count = epoch_length.batches_of(arguments.get("x"), batch,
                                            split=arguments["validation_split"], validation=True)
        checks.append(lambda params: epoch_length.check_counts(count, "fit's validation data"))
    holder = keras.callbacks.Callback()
    holder.on_train_begin = lambda logs=None: [check(holder.params or {}) for check in checks]
    return [holder] if checks else []


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
        if basics.size() > 1:
            added += drift_check.callbacks(model)
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
        bound = signature.bind(model, *args, **kwargs)
        phases.boundary(strategy, phases.EVALUATE, bound.arguments.get("steps"))
        callbacks = bound.arguments.get("callbacks")
        if (strategy.mode != "async" and bound.arguments.get("steps") is None
                and (callbacks is None or isinstance(callbacks, (list, tuple)))
                and not epoch_length.sized_by_hooks()):
            # A call of the user's (fit's validation passes its own
            # CallbackList, and fit compared those counts).
            import keras
            check = keras.callbacks.Callback()
            check.on_test_begin = lambda logs=None: epoch_length.check_counts(
                (check.params or {}).get("steps"), "evaluate")
            bound.arguments["callbacks"] = list(callbacks or []) + [check]
            args, kwargs = bound.args[1:], bound.kwargs
    strategy = async_mode(model)
    if strategy is None:
        return original(model, *args, **kwargs)
    with strategy.extended.local_input():
        return original(model, *args, **kwargs)


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
        if hasattr(self, "inner_optimizer") and is_bps_strategy(tf.distribute.get_strategy()):
            # A LossScaleOptimizer built under the strategy: only loss
            # scaling needs the agreed inf/nan check.
            hooks.require_entry(CHECK_FINITE, "Loss scaling (LossScaleOptimizer) under "
                                              "BytePSStrategy")
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


@_register(CHECK_FINITE,
           "the inf/nan check agreed across replicas and workers",
           "Keras checks each replica's gradients before they are summed and acts on that "
           "alone; a worker skipping a step alone would desynchronise the job",
           feature="loss scaling (LossScaleOptimizer) under BytePSStrategy")
def _check_finite(original):
    @functools.wraps(original)
    def check_finite(self, grads):
        return loss_scale.agreed_finite(self, original(self, grads), is_bps_strategy)
    return check_finite


def install() -> None:
    """Installs the Keras hooks of BytePSStrategy (once per process; the
    strategy calls it). A missing entry whose policy is "error" raises
    bps_tf.hooks.registry.HookError here, naming it and the Keras version;
    one that refuses a feature of its own raises when that feature is used."""
    import keras  # noqa: F401  (the hooks' targets)
    keras_shared.install()
    hooks.install(GROUP)
    hooks.install(optimizer_variables.GROUP)
    hooks.install("strategy.tf")
    hooks.require(GROUP, "BytePSStrategy")
    hooks.require("strategy.tf", "BytePSStrategy")
    if not epoch_length.sized_by_hooks():
        hooks.warn_fallback(epoch_length.GROUP,
                            "each epoch's step counts are checked to be equal on every worker "
                            "before its first step instead of being agreed (different counts "
                            "raise)")
