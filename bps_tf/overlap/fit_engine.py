"""The deferred apply behind ``model.fit``'s cross-step overlap (bps_tf.overlap.fit).

In step k the optimizer's ``apply`` only *starts* each dense gradient's
push_pull; in step k+1 each top-level layer, right before its forward pass,
waits for its own variables' sums and applies weight decay and
``update_step`` with step k's iteration count; :meth:`FitOverlap.flush`
applies what is still pending before anything else reads the weights. The
Keras side (when to set it up, the flush points) is bps_tf.overlap.fit.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from typing import Dict, List

import tensorflow as tf

from bps_tf.comm import collectives, naming
from bps_tf.overlap import fit_entries as entries
from bps_tf.overlap import guard as overlap_guard
from bps_tf.overlap.engine import DeferredApply, current_graph
from bps_tf.runtime import config

log = logging.getLogger("bps_tf")

_controllers: "weakref.WeakSet" = weakref.WeakSet()


def controllers() -> list:
    """Every live model's overlap engine."""
    return list(_controllers)
_model_count = [0]


class OverlapError(RuntimeError):
    """Overlap cannot be applied to this model exactly."""


class _Retrace(OverlapError):
    """Found while tracing the train step: ``fit`` retraces it with the barrier."""


def log_barrier(reason: str) -> None:
    log.warning("BytePSStrategy overlap: off for this model (barrier between steps): %s.", reason)


def _local_values(value) -> list:
    if isinstance(value, tf.distribute.DistributedValues):
        return list(value.values)
    return [value]


class _BatchRecorder:
    """Remembers the batches a train function takes eagerly from its
    iterator (Keras 3.16 takes one before calling the traced step), so that
    a retrace after a :class:`_Retrace` runs the same batch instead of
    skipping it. Batches taken inside the traced function (Keras 3.15) are
    not taken yet when tracing fails: nothing to replay then."""

    def __init__(self, iterator):
        self._iterator = iterator
        self._taken = []
        self._replay = []

    def _get_next_as_optional(self):
        if self._replay:
            return self._replay.pop(0)
        value = type(self._iterator).get_next_as_optional(self._iterator)
        if tf.executing_eagerly():
            self._taken.append(value)
        return value

    def _attach(self):
        return entries.ITERATOR_NEXT.apply(self._iterator, self._get_next_as_optional)

    def _detach(self):
        entries.ITERATOR_NEXT.remove(self._iterator)

    def __enter__(self):
        if hasattr(type(self._iterator), "get_next_as_optional") and not self._attach():
            self._iterator = None
        return self

    def __exit__(self, *exc):
        if self._iterator is not None and hasattr(type(self._iterator), "get_next_as_optional"):
            self._detach()
        return False

    @contextlib.contextmanager
    def replaying(self):
        self._replay, self._taken = list(self._taken), []
        with self:
            yield
        self._replay = []


class FitOverlap(DeferredApply):
    """The deferred apply of one model's optimizer under BytePSStrategy."""

    def __init__(self, model, strategy):
        variables = list(model.trainable_variables)
        _model_count[0] += 1   # same order on every worker: fit is collective
        super().__init__(variables,
                         naming.overlap_index_keys(len(variables), f"fit{_model_count[0]}"),
                         f"model {model.name!r}")
        self.model = model
        self.strategy = strategy
        self.optimizer = model.optimizer
        for key, v in zip(self.keys, self.variables):
            collectives.label_tensor(key, naming.variable_name(v))
        self._fifo = not config.value("BYTEPS_PRIORITY_SCHEDULING")
        self._active = 0          # train steps being traced right now
        self._graph = None        # the replica graph of the step being traced
        self.enabled = True
        self._sparse_logged = set()
        if not self.optimizer.built:
            self.optimizer.build(self.variables)
        # The iteration count of the pending gradients, read by their
        # deferred update as `iterations` (written by the start of a step).
        with strategy.scope():
            self._step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                     name="bps_overlap_step")
            # Their learning rate, as apply() computed it in their step:
            # a schedule recomputed elsewhere may round differently.
            self._lr = tf.Variable(0.0, dtype=tf.float32, trainable=False,
                                   name="bps_overlap_learning_rate")
        self._hook_layers()
        self._patch_optimizer()
        self._patch_train_step()
        _controllers.add(self)
        self._handles = overlap_guard.resource_handles(self.variables)
        overlap_guard.watch(self.variables, self._handles, self)

    # -- installation ------------------------------------------------------
    def _hook_layers(self):
        """Each variable is applied before the forward of the top-level layer
        that holds it (the model's own ``call`` for the rest)."""
        groups: Dict[int, List[int]] = {}
        owners = {}
        placed = set()
        for layer in list(getattr(self.model, "layers", [])):
            for v in layer.trainable_variables:
                i = self._index.get(id(v))
                if i is not None and i not in placed:
                    placed.add(i)
                    groups.setdefault(id(layer), []).append(i)
                    owners[id(layer)] = layer
        rest = [i for i in range(len(self.variables)) if i not in placed]
        if rest:
            groups[id(self.model)] = rest
            owners[id(self.model)] = self.model
        for key, indices in groups.items():
            self._hook(owners[key], tuple(indices))

    def _hook(self, layer, indices):
        def before():
            if self._active and self.enabled:
                self._apply_before_forward(layer, indices)
        self.hook_call(layer, before, self)

    def _patch_optimizer(self):
        opt = self.optimizer
        weight_decay = entries.WEIGHT_DECAY.original(opt)
        update_step = entries.UPDATE_STEP.original(opt)

        def deferred_weight_decay(variables):
            if not (self._active and self.enabled):
                return weight_decay(variables)
            return None   # applied with the deferred update

        def deferred_update_step(grads, trainable_variables, learning_rate):
            if not (self._active and self.enabled):
                return update_step(grads, trainable_variables, learning_rate)
            sparse = [(g, v) for g, v in zip(grads, trainable_variables)
                      if isinstance(g, tf.IndexedSlices)]
            dense = [(g, v) for g, v in zip(grads, trainable_variables)
                     if g is not None and not isinstance(g, tf.IndexedSlices)]
            if sparse:
                self._log_sparse([v for _, v in sparse])
                weight_decay([v for _, v in sparse])
                update_step([g for g, _ in sparse], [v for _, v in sparse], learning_rate)
            if dense:
                tf.distribute.get_replica_context().merge_call(
                    self._start, args=([g for g, _ in dense], [v for _, v in dense],
                                       tf.convert_to_tensor(learning_rate)))
            return None

        entries.WEIGHT_DECAY.apply(opt, deferred_weight_decay)
        entries.UPDATE_STEP.apply(opt, deferred_update_step)

    def _patch_train_step(self):
        original = self.model.train_step

        @functools.wraps(original)
        def train_step(data):
            if not self.enabled:
                return original(data)
            self._active += 1
            graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
            self._graph = graph
            try:
                outputs = original(data)
            finally:
                self._active -= 1
            if graph is not None and not self._active:
                self._finish_trace(graph)
            return outputs
        entries.TRAIN_STEP.apply(self.model, train_step)

    def _finish_trace(self, graph):
        """Checks the traced step's reads (bps_tf.overlap.guard.stale_reads:
        raises _Retrace if one is outside its variable's overlap window).
        Each start's priority is the C++ priority pass's (bps_tf/ops/
        priority_pass.cc): the start takes the rank of the variable its key's
        wait updates, by that variable's first read in the step."""
        kept = {i: w for i, w in self.windows.get(graph, {}).items() if w[0] is not None}
        position = overlap_guard.op_positions(graph) or {}
        windows = {i: (applied, position.get(op, 0) if op is not None else None)
                   for i, (applied, op) in kept.items()}
        handles = {i: overlap_guard.resource_handles([self.variables[i]]) for i in windows}
        names = {i: naming.variable_name(self.variables[i]) for i in windows}
        stale = overlap_guard.stale_reads(graph, handles, windows, names)
        if stale:
            raise _Retrace(f"the train step reads weights outside the layers' own forward "
                           f"passes ({'; '.join(stale[:3])}{'; ...' if len(stale) > 3 else ''})")

    @property
    def priorities(self) -> Dict[str, int]:
        """key -> the priority the pass gave its start (once the step ran)."""
        decided = collectives.decided_priorities()
        return {k: decided[k] for k in self.keys if k in decided}

    def disable(self, reason: str) -> None:
        """Back to the barrier for this model (eager): pending updates are
        applied first."""
        self.flush()
        self.enabled = False
        overlap_guard.unwatch(self.variables, self._handles)
        log_barrier(reason)

    def guard(self, train_function):
        """``train_function`` that marks the model dirty and, if tracing
        found a read overlap cannot serve exactly, retraces with the barrier."""
        model = self.model

        @functools.wraps(train_function)
        def guarded(*args, **kwargs):
            if not self.enabled:
                return train_function(*args, **kwargs)
            batches = _BatchRecorder(args[0] if args else None)
            try:
                with self.step_lock.held(), overlap_guard.in_train_step.scope(), batches:
                    self.dirty = True
                    return train_function(*args, **kwargs)
            except _Retrace as exc:
                # Raised while tracing, before the step ran: nothing started.
                # A batch Keras already took eagerly (3.16+) is fed again.
                self.disable(str(exc).splitlines()[0])
                model.make_train_function(force=True)
                with batches.replaying():
                    return model.train_function(*args, **kwargs)
        return guarded

    def _log_sparse(self, variables):
        names = [naming.variable_name(v) for v in variables
                 if naming.variable_name(v) not in self._sparse_logged]
        if names:
            self._sparse_logged.update(names)
            log.warning("BytePSStrategy overlap: %s get sparse gradients (IndexedSlices); "
                        "their updates keep the barrier (applied in the step).", ", ".join(names))

    # -- the two halves ----------------------------------------------------
    def _apply_before_forward(self, layer, indices):
        """In the replica context of a traced train step."""
        if tf.executing_eagerly():
            raise OverlapError("BytePSStrategy overlap needs a traced train step "
                               "(model.compile(run_eagerly=False)); use overlap=False.")
        graph = tf.compat.v1.get_default_graph()
        if graph is not self._graph:
            raise _Retrace(
                f"BytePSStrategy overlap: layer {layer.name!r} is called inside control flow "
                f"(a loop or condition in the train step), where its pending update cannot be "
                f"applied before its forward pass")
        done = self.applied(graph)
        todo = [i for i in indices if i not in done]
        if todo:
            tf.distribute.get_replica_context().merge_call(
                lambda _strategy: self.apply_pending(todo))

    def _start(self, strategy, grads, variables, learning_rate):
        """Cross-replica: starts the sums of this step's dense gradients."""
        del strategy
        indices = [self._index_of(v) for v in variables]
        graph = current_graph()
        done = self.applied(graph) if graph is not None else {}
        # A variable whose layer did not run in this step: its pending
        # update goes first (the same key cannot be started twice).
        missing = [i for i in indices if i not in done]
        if missing:
            self.apply_pending(missing)
        # Read before apply() counts this step.
        self._step.assign(tf.convert_to_tensor(self.optimizer.iterations.value))
        self._lr.assign(tf.cast(_local_values(learning_rate)[0], tf.float32))
        local = []
        for grad in grads:
            values = [tf.convert_to_tensor(g) for g in _local_values(grad)]
            with tf.device(values[0].device):
                local.append(values[0] if len(values) == 1 else tf.math.add_n(values))
        self.start_sums(indices, local, lambda i: 0 if self._fifo else -i)

    def _index_of(self, variable) -> int:
        i = self._index.get(id(variable))
        if i is None:
            raise OverlapError(f"BytePSStrategy overlap: the optimizer updates "
                               f"{naming.variable_name(variable)}, which is not one of the "
                               f"model's trainable variables; use overlap=False.")
        return i

    @contextlib.contextmanager
    def _pending_step(self):
        """``optimizer.iterations`` reads the pending gradients' step (a
        variable, as in the barrier's update: the same ops, the same rounding)."""
        with entries.ITERATIONS.swapped(self.optimizer, self._step):
            yield

    def update(self, i, grad):
        """Weight decay then ``update_step`` on variable ``i``, as the
        optimizer's apply does, for the pending step (cross-replica). The
        weight decay is Keras' own step, copied (Keras' method merges into
        a replica context, and this runs in cross-replica context): a
        registry entry checks that Keras' step is still the one copied
        (bps_tf.overlap.fit_entries.WEIGHT_DECAY_STEP)."""
        var = self.variables[i]
        opt = self.optimizer
        learning_rate = self._lr
        use_weight_decay = entries.USE_WEIGHT_DECAY.original(opt)
        with self._pending_step():
            def fn(v, g):
                if opt.weight_decay is not None and use_weight_decay(v):
                    lr = tf.cast(learning_rate, v.dtype)
                    wd = tf.cast(opt.weight_decay, v.dtype)
                    v.assign_sub(v * wd * lr)
                return opt.update_step(g, v, learning_rate)
            self.strategy.extended.update(var.value, fn, args=(grad,), group=False)

    # -- flush ---------------------------------------------------------------
    def flush(self) -> int:
        """Waits for and applies every pending update (eager). Returns how
        many variables were updated; a second flush applies nothing."""
        if not tf.executing_eagerly():
            return 0
        with self.step_lock.held():   # a step running in another thread ends first
            if self._active:
                return 0
            return self.flush_pending(self.strategy.scope())
