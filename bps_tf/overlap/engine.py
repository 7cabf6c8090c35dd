"""The one cross-step overlap engine, under both faces.

In step k each gradient's push_pull is only *started*
(``BytepsPushPullStart``); in step k+1, right before the forward pass of the
layer that holds a variable, its sum is waited for (``BytepsPushPullWait``)
and its update applied; :meth:`DeferredApply.flush` applies whatever is
still pending before anything else reads the weights. The faces differ only
in *how* one variable is updated and *when* the layers' hooks act:

* bps_tf.overlap.fit_engine.FitOverlap -- ``model.fit`` under BytePSStrategy
  (the optimizer's own deferred update step, inside the traced train step);
* bps_tf.overlap.loop.OverlappedApply -- custom training loops
  (``optimizer.apply`` per variable).

What is kept per traced graph: the op of each variable's deferred update in
that graph (a start of the same key must come after it), its start (a wait
of the same key later in the graph must come after it), and the window of
op ids between them, which bps_tf.overlap.guard checks every other read of
the variable against.
"""
from __future__ import annotations

import functools
import weakref
from typing import Dict, List, Optional, Sequence

import tensorflow as tf

from bps_tf.comm import collectives
from bps_tf.hooks.entries import InstancePatch
from bps_tf.hooks.roles import keras_class
from bps_tf.overlap import guard as overlap_guard

# A layer's forward pass, replaced on the layers whose variables an engine
# applies (each engine's own layers only).
LAYER_CALL = InstancePatch(
    "keras.Layer.call (per layer)", overlap_guard.GROUP, keras_class("keras.Layer"), "call",
    "keras.Layer", changes="a pending update of the layer's variables is applied right before "
                           "its forward pass", why="the overlap applies each variable's update "
                                                   "where its layer first reads it; no Keras "
                                                   "callback runs inside a traced step",
    when_missing="fallback", private=False)


def current_graph():
    """The graph being built, or None when executing eagerly."""
    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


def last_op_id(graph) -> int:
    """Position of the op created last in ``graph``: TensorFlow numbers a
    graph's ops 1, 2, ... in creation order, and ``Graph.version`` is the
    last number given (bps_tf.overlap.guard.op_positions numbers them the
    same way)."""
    return graph.version


class DeferredApply:
    """Keys, waits, updates, starts and flushes of one set of variables.

    Subclasses define :meth:`update` (one variable's update with its sum,
    in the context the face runs it in) and call :meth:`hook_layers`,
    :meth:`apply_pending`, :meth:`start_sums` and :meth:`flush_pending`.
    """

    def __init__(self, variables: Sequence, keys: Sequence[str], what: str):
        self.variables = list(variables)
        self.keys = list(keys)
        self._index = {id(v): i for i, v in enumerate(self.variables)}
        # graph -> {variable index: op of its deferred update in that graph}
        self._applied: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        # graph -> {variable index: op of its start in that graph}
        self._started: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        # graph -> {variable index: [(first, last) op ids of its apply, id of its start]}
        self.windows: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._flush_fns: Dict[tuple, object] = {}
        self.step_lock = overlap_guard.StepLock(what)
        self.dirty = False        # a step ran since the last flush

    # -- what the faces define ---------------------------------------------
    def update(self, i: int, summed) -> None:
        """Applies variable ``i``'s update with the sum ``summed``."""
        raise NotImplementedError

    # -- layers ---------------------------------------------------------------
    def index_of(self, variable) -> Optional[int]:
        return self._index.get(id(variable))

    @staticmethod
    def hook_call(layer, before, mark) -> None:
        """Runs ``before()`` in front of ``layer``'s ``call`` (once per
        ``mark``: an engine hooks a layer once)."""
        original = layer.call
        if getattr(original, "_bps_overlap", None) is mark:
            return

        @functools.wraps(original)
        def call(*args, **kwargs):
            before()
            return original(*args, **kwargs)

        call._bps_overlap = mark
        LAYER_CALL.apply(layer, call)

    # -- the two halves ------------------------------------------------------
    def applied(self, graph) -> dict:
        return self._applied.setdefault(graph, {})

    def apply_pending(self, indices) -> int:
        """Waits for and applies the pending sums of ``indices`` (each once
        per traced graph). Eager: returns how many were applied."""
        graph = current_graph()
        count = 0
        for i in indices:
            if graph is None:
                count += int(self._wait_and_update(i, None))
                continue
            done = self.applied(graph)
            if i not in done:
                done[i] = self._wait_and_update(i, graph)
        return count

    def _wait_and_update(self, i: int, graph):
        var = self.variables[i]
        first = last_op_id(graph) if graph is not None else None
        started = self._started.get(graph, {}).get(i) if graph is not None else None
        with tf.control_dependencies([started] if started is not None else []):
            summed, valid = collectives.push_pull_wait(tf.zeros(var.shape, var.dtype),
                                                       self.keys[i])
        if graph is None:
            if bool(valid):
                self.update(i, summed)
                return True
            return False

        def run():
            self.update(i, summed)
            return tf.constant(True)
        op = tf.cond(valid, run, lambda: tf.constant(False))
        self.windows.setdefault(graph, {})[i] = [(first, last_op_id(graph)), None]
        return op

    def start_sums(self, indices: Sequence[int], grads: Sequence, priority) -> List:
        """Starts the push_pulls of ``grads`` (one per index; ``priority(i)``
        is each start's priority before the C++ pass ranks it). A start may
        not overtake the wait of the same key: it depends on the update
        applied earlier in this graph."""
        graph = current_graph()
        done = self.applied(graph) if graph is not None else {}
        tokens = []
        for i, grad in zip(indices, grads):
            with tf.control_dependencies([done[i]] if i in done else []):
                token = collectives.push_pull_start(grad, self.keys[i], priority=priority(i))
            if graph is not None:
                done.pop(i, None)      # a later step in this graph waits again
                self._started.setdefault(graph, {})[i] = token
                self.windows.setdefault(graph, {}).setdefault(i, [None, None])[1] = token.op
            tokens.append(token)
        return tokens

    # -- flush ---------------------------------------------------------------
    def pending(self) -> List[str]:
        """This engine's keys still pending (eager)."""
        mine = set(self.keys)
        return [k for k in collectives.pending_push_pulls() if k in mine]

    def flush_pending(self, context=None) -> int:
        """Eager: waits for and applies every pending sum, traced (Grappler
        rewrites a graph's update -- RMSprop's ``x / sqrt(y)`` becomes ``x *
        rsqrt(y)`` -- so an eager update would differ from the step's by an
        ulp). Returns how many variables were updated; a second flush
        applies nothing. ``context``: a context manager to run it in."""
        self.dirty = False
        pending = set(self.pending())
        if not pending:
            return 0
        indices = tuple(i for i, k in enumerate(self.keys) if k in pending)
        fn = self._flush_fns.get(indices)
        if fn is None:
            def flush_graph():
                graph = current_graph()
                self.apply_pending(indices)
                done = self._applied.pop(graph, {})
                self._started.pop(graph, None)
                self.windows.pop(graph, None)
                return tf.add_n([tf.cast(done[i], tf.int32) for i in indices])
            fn = self._flush_fns[indices] = tf.function(flush_graph, autograph=False)
        with overlap_guard.flushing.scope():
            if context is None:
                return int(fn())
            with context:
                return int(fn())
