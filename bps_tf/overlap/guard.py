"""What keeps ``BytePSStrategy`` overlap exact when code reads weights in
places the per-layer hooks of :mod:`bps_tf.overlap.fit` do not see.

Under overlap, a variable's update of step k is applied right before the
forward of the layer that holds it in step k+1. A read anywhere else would
see the weight one update behind, which the barrier never shows. Three
guards close that gap:

* **In the traced train step** (:func:`stale_reads`): once the step is
  traced, every op of the step's graph that uses a pending variable's
  resource must come after that variable's deferred update and before its
  next push_pull is started. TensorFlow runs the ops of one resource in the
  order they were created, so op creation order is run order for them. A
  read outside that window (a layer reading another layer's weights before
  that layer ran, a ``train_step`` that reads weights after ``apply``, a
  metric over weights) makes ``fit`` retrace the step with the barrier,
  with one log line naming the variable and the op.
* **Reads and writes between steps** (:func:`install_flushes`): reading
  a watched variable's value eagerly (``numpy()``, ``layer.get_weights()``,
  ``tf.convert_to_tensor``, a ``tf.train.Checkpoint`` restore), writing it
  (``assign``, ``set_weights``, ``load_weights``: the write must land after
  the pending update, as under the barrier, not be overwritten by it), or
  running a ``tf.function`` that captures it (a callback's, the caller's
  between ``train_on_batch`` calls), while a step has run since the last
  flush first applies every pending update of its model. The train
  function itself is exempt: its layers apply their own updates.
* **Reads from another thread during a step** (:class:`StepLock`): a train
  step holds its model's lock while it runs and a flush takes the same
  lock, so a read from another thread waits for the step to end and then
  sees the barrier's weights, instead of flushing keys the step is waiting
  on itself (or reading weights one update behind).
"""
from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Dict, List, Optional

import tensorflow as tf

from bps_tf.comm import naming
from bps_tf.hooks import registry as hooks
from bps_tf.hooks import roles

_state = threading.local()


def stale_reads(graph, handles: Dict[int, List], windows: Dict[int, tuple],
                names: Dict[int, str], first_reads: Optional[Dict[int, int]] = None
                ) -> List[str]:
    """Reads of ``graph`` that would see a variable one update behind.

    ``handles``: variable index -> its eager resource handles;
    ``windows``: variable index -> ((ids of the ops that apply its pending
    update: after the first, up to the last), id of the op that starts its
    next push_pull or None).
    ``first_reads`` (filled in): variable index -> id of the first op that
    uses it inside its window (its first read in the forward pass).
    """
    internal = {}
    for external, placeholder in graph.captures:
        internal.setdefault(id(external), []).append(placeholder)
    position = op_positions(graph)
    if position is None:
        return ["the order of the step's ops cannot be told (ops were removed from its graph)"]
    found = []
    for i, ((before, last), started) in windows.items():
        for handle in handles.get(i, []):
            for placeholder in internal.get(id(handle), []):
                for op in placeholder.consumers():
                    at = position[op]
                    if before < at <= last:
                        continue   # the deferred update itself
                    early = at <= before
                    late = started is not None and at > started
                    if early or late:
                        when = ("before its pending update is applied" if early else
                                "after its gradient's push_pull is started")
                        found.append(f"{op.type} op {op.name!r} uses {names[i]} {when}")
                    elif first_reads is not None:
                        first_reads[i] = min(first_reads.get(i, at), at)
    return found


def op_positions(graph):
    """{op: its position in ``graph``}: 1, 2, ... in creation order, as
    ``Graph.version`` counts them (bps_tf.overlap.engine.last_op_id); None
    when the two disagree (an op was removed), and positions cannot be
    compared with the windows then."""
    ops = graph.get_operations()
    if len(ops) != graph.version:
        return None
    return {op: n for n, op in enumerate(ops, start=1)}


# --------------------------------------------------------------------------
# Models the deferred apply cannot serve
# --------------------------------------------------------------------------
def needs_the_whole_step(optimizer) -> Optional[str]:
    """Why ``optimizer``'s update needs every variable's gradient at once
    (so no update can be deferred per layer), or None."""
    if hasattr(optimizer, "inner_optimizer"):
        return "loss scaling (LossScaleOptimizer) checks all gradients for inf/nan at once"
    if getattr(optimizer, "use_ema", False):
        return "EMA (use_ema) averages all weights after the whole update"
    if getattr(optimizer, "gradient_accumulation_steps", None):
        return "gradient accumulation applies on a step count shared by all variables"
    import keras
    if isinstance(optimizer, keras.optimizers.Nadam) or hasattr(optimizer, "_u_product"):
        # Nadam advances one product for all variables once per apply():
        # a per-variable apply would advance it once per variable.
        return "Nadam's momentum schedule product is advanced once per step for all variables"
    return None


def fallback_reason(model, strategy) -> Optional[str]:
    """Why ``model.fit`` must keep the barrier for this model, or None."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return "the model has no optimizer"
    if getattr(strategy, "compressed", False):
        return "compression is applied by the barrier's reduction only"
    unverified = unverified_reason(optimizer)
    if unverified:
        return unverified
    whole_step = needs_the_whole_step(optimizer)
    if whole_step:
        return whole_step
    for v in model.trainable_variables:
        if getattr(v, "constraint", None) is not None:
            return f"variable {naming.variable_name(v)} has a constraint applied after all updates"
        if getattr(v, "overwrite_with_gradient", False):
            return f"variable {naming.variable_name(v)} is overwritten with its gradient"
    if not model.trainable_variables:
        return "the model has no trainable variables"
    if strategy.num_replicas_in_sync > _size():
        return "several local devices per worker (not verified bit for bit yet)"
    if getattr(model, "run_eagerly", False):
        return "the train step runs eagerly (run_eagerly=True)"
    import keras
    if type(model).train_step is not keras.Model.train_step:
        # It may read weights outside the layers' own calls, before their
        # deferred update: a different model, without a word.
        return f"{type(model).__name__} overrides train_step"
    owners = {}
    for layer in model.layers:
        for v in layer.trainable_variables:
            if owners.setdefault(id(v), layer.name) != layer.name:
                return (f"variable {naming.variable_name(v)} is shared by layers "
                        f"{owners[id(v)]!r} and {layer.name!r}")
    return None


def unverified_reason(optimizer) -> Optional[str]:
    """Why ``optimizer``'s deferred update is not known to be exact, or None."""
    verified = _verified_optimizers()
    if type(optimizer) in verified:
        return None
    return (f"{type(optimizer).__name__} is not among the optimizers whose deferred update is "
            f"verified bit-identical to the barrier's "
            f"({', '.join(c.__name__ for c in verified)})")


def _verified_optimizers() -> tuple:
    """Optimizer classes whose deferred update is bit-identical to the
    barrier's (tests/test_overlap_fit.py; docs/overlap.md): each update
    reads only its own variable, its slots, the learning rate and the
    iteration count. An exact type: a subclass may read more."""
    import keras
    o = keras.optimizers
    return (o.SGD, o.Adam, o.AdamW, o.RMSprop, o.Adagrad, o.Adadelta, o.Adamax, o.Ftrl,
            o.Lion, o.Adafactor)


def _size() -> int:
    from bps_tf.runtime import basics
    return basics.size()


# --------------------------------------------------------------------------
# Reads between steps
# --------------------------------------------------------------------------
# id of a Keras variable, or of one of its resource handles -> its controller
_watched: "Dict[int, weakref.ref]" = {}
_watched_handles: "Dict[int, weakref.ref]" = {}
# the graph a custom loop's train step was traced in -> its OverlappedApply
_train_graphs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def resource_handles(variables) -> list:
    """The eager resource handles of ``variables`` (Keras or tf variables;
    every local copy of a distributed one)."""
    handles = []
    for v in variables:
        value = getattr(v, "value", v)
        parts = value.values if isinstance(value, tf.distribute.DistributedValues) else [value]
        handles += [p.handle for p in parts]
    return handles


def mark_train_graph(graph, controller) -> None:
    """Running a function of ``graph`` is a train step of ``controller``:
    it applies its own pending updates and leaves new ones (dirty)."""
    _train_graphs[graph] = weakref.ref(controller)


def watch(variables, handles, controller) -> None:
    """Reads of ``variables`` (eager, or through a function capturing one of
    ``handles``) flush ``controller`` first when it is dirty."""
    ref = weakref.ref(controller)
    for v in variables:
        _watched[id(v)] = ref
    for h in handles:
        _watched_handles[id(h)] = ref


def unwatch(variables, handles) -> None:
    for v in variables:
        _watched.pop(id(v), None)
    for h in handles:
        _watched_handles.pop(id(h), None)


class _Flag:
    """A per-thread flag set inside a ``with`` block."""

    def __init__(self, name):
        self.name = name

    def __bool__(self):
        return getattr(_state, self.name, False)

    @contextlib.contextmanager
    def scope(self):
        saved = bool(self)
        setattr(_state, self.name, True)
        try:
            yield
        finally:
            setattr(_state, self.name, saved)


class StepLock:
    """Serializes one controller's train steps and flushes across threads
    (re-entrant: a step's own flushes and reads pass)."""

    def __init__(self, what: str):
        self.what = what
        self._lock = threading.RLock()

    @contextlib.contextmanager
    def held(self):
        if not self._lock.acquire(blocking=False):
            from bps_tf.runtime import config
            limit = config.value("BYTEPS_OVERLAP_READ_TIMEOUT")
            if not self._lock.acquire(timeout=limit if limit > 0 else -1):
                # A deadlock would be a hang: e.g. a py_function inside the
                # step reading the weights from one of TensorFlow's threads.
                raise RuntimeError(
                    f"BytePSStrategy overlap: waited {limit:g} s for a train step of {self.what} "
                    f"running in another thread to end before reading its weights "
                    f"(BYTEPS_OVERLAP_READ_TIMEOUT). If the step itself reads the weights from "
                    f"another thread (a py_function), read them in the step instead, or turn "
                    f"overlap off (BytePSStrategy(overlap=False)).")
        try:
            yield
        finally:
            self._lock.release()


flushing = _Flag("flushing")        # applying pending updates: no nested flush
in_train_step = _Flag("in_step")    # running the train function: layers apply their own


def _flush(ref) -> None:
    ctl = ref()
    if ctl is not None and ctl.dirty:
        ctl.flush()


GROUP = "overlap.guard"
_WHY_READS = ("reads of a weight between steps must see the barrier's value; Keras and "
              "TensorFlow read variables without calling the strategy")


def _concrete_function_class():
    return hooks.defining_class(roles.concrete_function_class(), "_call_flat"), "_call_flat"


@hooks.register("keras.Variable.value", GROUP, hooks.attribute_of("keras.Variable", "value"),
                changes="an eager read of a weight whose model has pending overlapped updates "
                        "applies them first", why=_WHY_READS, when_missing="fallback")
def _value(original):

    def value(self):
        ref = _watched.get(id(self))
        if ref is not None and not flushing and tf.executing_eagerly():
            _flush(ref)
        return original.fget(self)
    return property(value, doc=original.__doc__)


def _flush_before_write(original):

    @functools.wraps(original)
    def write(self, *args, **kwargs):
        ref = _watched.get(id(self))
        if ref is not None and not flushing and tf.executing_eagerly():
            _flush(ref)
        return original(self, *args, **kwargs)
    return write


for _name in ("assign", "assign_add", "assign_sub"):
    hooks.register(f"keras.Variable.{_name}", GROUP, hooks.attribute_of("keras.Variable", _name),
                   changes="an eager write of a weight whose model has pending overlapped "
                           "updates applies them first, so the write lands after them as under "
                           "the barrier (set_weights, load_weights, a callback's assign)",
                   why="Keras writes a variable's value directly; tf.distribute sees no write "
                       "made outside a replica or cross-replica update",
                   when_missing="fallback")(_flush_before_write)


@hooks.register("tf ConcreteFunction._call_flat", GROUP, _concrete_function_class,
                changes="a traced function that captures a weight with pending overlapped "
                        "updates applies them first; the train function marks its model",
                why=_WHY_READS + "; a tf.function reads captured variables directly",
                when_missing="fallback", private=True,
                found_by="role: the class of a traced tf.function's concrete function")
def _call_flat_wrapper(call_flat):

    def _call_flat(self, tensor_inputs, captured_inputs):
        if _watched_handles and not flushing and tf.executing_eagerly():
            train = _train_graphs.get(getattr(self, "graph", None))
            if train is not None:
                ctl = train()
                if ctl is not None:
                    with ctl.step_lock.held():
                        ctl.dirty = True
                        return call_flat(self, tensor_inputs, captured_inputs)
            elif not in_train_step:
                for tensor in captured_inputs:
                    ref = _watched_handles.get(id(tensor))
                    if ref is not None:
                        _flush(ref)
        return call_flat(self, tensor_inputs, captured_inputs)
    return _call_flat


def install_flushes() -> Dict[str, str]:
    """Installs the read guards (once); returns {hook: why} of those whose
    target this Keras/TensorFlow moved (the overlap must not run then)."""
    return hooks.install(GROUP)
