"""Cross-step overlap for an unchanged ``model.fit`` under ``BytePSStrategy`` (on by default).

The same deferred per-layer apply as :mod:`bps_tf.overlap`, fitted into the
Keras 3 train step that the strategy runs:

* in step k, the optimizer's ``apply`` (clipping, unscaling and the
  iteration count as always) only *starts* the push_pull of each dense
  gradient (``BytepsPushPullStart``) instead of reducing it and updating;
* in step k+1, each top-level layer, right before its forward pass, waits for
  the sums of its own variables (``BytepsPushPullWait``) and applies weight
  decay and the optimizer's ``update_step`` with step k's iteration count;
* before anything reads the weights (end of an epoch, end of ``fit``,
  ``evaluate``, ``predict``, ``save``, ``save_weights``, ``get_weights``,
  the checkpoint callbacks, the process's exit) :meth:`FitOverlap.flush`
  applies whatever is still pending; reads elsewhere (in the traced step,
  eager reads, tf.functions run between steps) are caught by
  :mod:`bps_tf.overlap.guard`;
* each start's priority comes from the traced step: the variable the
  forward pass reads first leaves first.

A layer's read of its weights in step k+1 thus waits only for its own
update (TensorFlow orders stateful ops per resource), so the first layers
compute while later layers' sums are still on the wire.

Exact by design (same values, same order, same iteration count): each
variable's update in Keras 3 reads only that variable, its slots, the
learning rate and ``iterations``; clipping (``clipnorm``, ``clipvalue``,
``global_clipnorm``) acts on the local gradients before the reduction in
both modes. Falls back to the barrier, with one log line, for optimizers
not verified bit for bit (Nadam, subclasses, other optimizers) and for
what needs every update at once or reads the weights inside
the step: EMA, loss scaling, gradient accumulation, variable constraints,
``overwrite_with_gradient`` variables, compression, several local devices,
``run_eagerly``. Sparse gradients (``IndexedSlices``,
Embedding) take the barrier path for their own variables, with one log line.
"""
from __future__ import annotations

import atexit
import functools
import logging
import weakref
from typing import Optional

from bps_tf.overlap import fit_engine, fit_entries
from bps_tf.overlap import guard as overlap_guard
from bps_tf.overlap.fit_engine import FitOverlap, OverlapError  # noqa: F401  (the engine)
from bps_tf.hooks import registry as hooks

log = logging.getLogger("bps_tf")

_installed = [False]
# model -> its FitOverlap (None: set up, then turned off); models looked at
_controllers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_checked: "weakref.WeakSet" = weakref.WeakSet()


# --------------------------------------------------------------------------
# Keras: when to set it up, and the flush points
# --------------------------------------------------------------------------
def controller(model) -> Optional[FitOverlap]:
    try:
        return _controllers.get(model)
    except TypeError:     # not weakly referenceable: never set up
        return None


def flush_model(model) -> int:
    """Applies ``model``'s pending overlapped updates, if any (eager)."""
    ctl = controller(model)
    return ctl.flush() if ctl is not None else 0


def flush_all() -> None:
    """Every model's pending updates (the process's exit)."""
    for ctl in fit_engine.controllers():
        try:
            ctl.flush()
        except Exception as exc:  # pylint: disable=broad-except
            log.warning("BytePSStrategy overlap: pending updates of a model were lost at "
                        "exit: %s", exc)


def _ensure(model):
    """Sets up the overlap for ``model`` if its strategy asks for it (once)."""
    strategy = getattr(model, "distribute_strategy", None)
    ctl = controller(model)
    if ctl is not None and ctl.optimizer is not getattr(model, "optimizer", None):
        # compile() again: the hooks serve the old optimizer only.
        ctl.flush()
        _controllers[model] = None
        log.warning("BytePSStrategy overlap: off for this model after compile() with a new "
                    "optimizer (barrier between steps).")
        return
    if not getattr(strategy, "overlap", False) or model in _checked:
        return
    _checked.add(model)
    reason = overlap_guard.fallback_reason(model, strategy)
    if reason is not None:
        fit_engine.log_barrier(reason)
        return
    _controllers[model] = FitOverlap(model, strategy)


def _flush_first(model_of=lambda self: self):
    """A hook's wrap: the model's pending updates are applied, then the original runs."""
    def wrap(original):
        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            model = model_of(self)
            if model is not None:
                flush_model(model)
            return original(self, *args, **kwargs)
        return wrapper
    return wrap


GROUP = "overlap.fit"
# Reads of the weights are caught one by one by bps_tf.overlap.guard; these
# apply everything pending at the points where a file is written or fit()
# returns, whatever path the read takes there.
for _target in ("save", "save_weights"):
    hooks.register(f"keras.Model.{_target}", GROUP, hooks.attribute_of("keras.Model", _target),
                   changes="pending overlapped updates applied before the file is written",
                   why="a save reads the weights through paths of its own; nothing of "
                       "tf.distribute runs before", when_missing="fallback")(_flush_first())
hooks.register("keras.callbacks.CallbackList.on_train_end", GROUP,
               hooks.attribute_of("keras.callbacks.CallbackList", "on_train_end"),
               changes="pending overlapped updates applied when fit() ends, before the user's "
                       "callbacks", why="fit() has no tf.distribute call at its end",
               when_missing="fallback")(_flush_first(lambda callbacks: callbacks.model))


@hooks.register("keras.Model.make_train_function", GROUP,
                hooks.attribute_of("keras.Model", "make_train_function"),
                changes="sets up the overlap for the model and guards its train function",
                why="the deferred update lives in the traced train step; tf.distribute's run "
                    "cannot tell a train step from a test step", when_missing="fallback")
def _make_train_function(make_train_function):
    @functools.wraps(make_train_function)
    def make_train(self, force=False):
        _ensure(self)
        ctl = controller(self)
        fresh = force or self.train_function is None
        make_train_function(self, force=force)
        if ctl is not None and ctl.enabled and fresh and self.train_function is not None:
            self.train_function = ctl.guard(self.train_function)
        return self.train_function
    return make_train


def install() -> bool:
    """Installs the hooks that set up the overlap and flush it (once).
    False (after one warning naming them) when this Keras/TensorFlow moved one
    of them: every model then keeps the step barrier, which gives the same
    weights."""
    import keras  # noqa: F401  (the hooks' targets)
    gone = {**hooks.install(GROUP), **fit_entries.missing(), **overlap_guard.install_flushes()}
    if not _installed[0]:
        atexit.register(flush_all)
        _installed[0] = True
    if gone:
        hooks.warn_fallback((GROUP, overlap_guard.GROUP),
                            "cross-step overlap is off (barrier between steps: the same weights)")
        return False
    return True
