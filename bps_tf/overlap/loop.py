"""Cross-step overlap for custom training loops: a deferred, per-layer apply.

Without overlap a step ends with every gradient's push_pull and the
optimizer update, and the next step starts only when all of them are done.
:class:`OverlappedApply` splits that in two:

* at the end of step k, :meth:`OverlappedApply.start` *starts* the push_pull
  of each gradient (``BytepsPushPullStart``, which returns at once) and the
  step function returns;
* in step k+1, right before each layer's forward pass, a hook waits for the
  sums of that layer's own variables (``BytepsPushPullWait``) and applies the
  optimizer update to those variables only. The first layers get their
  weights (and start computing) while the later layers' sums are still on
  the wire; the priorities (earlier variables first) send them first.
* :meth:`OverlappedApply.flush` waits for and applies everything still
  pending: call it before evaluating, saving, reading the weights, and at the
  end of training.

Usage::

    model = ...                       # a built keras.Model (or Layer)
    optimizer = keras.optimizers.Adam(1e-3)
    overlap = bps_tf.overlap.OverlappedApply(model, optimizer)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:            # a plain tape
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        overlap.start(grads)                       # instead of optimizer.apply
        return loss

    for x, y in dataset:
        train_step(x, y)
    overlap.flush()                                # before evaluate / save / end

Exactness: after ``flush()`` the weights, the optimizer's slots and
``optimizer.iterations`` are bit-identical to the non-overlapped loop
(``DistributedGradientTape`` + ``optimizer.apply``) with the same data: each
variable receives the same averaged gradient (sum / size, as ``Average``)
and is updated with the same iteration count (bias correction, learning-rate
schedules). ``optimizer.iterations`` counts *started* steps: it is
incremented by ``start`` and each deferred update runs with the count of the
step its gradient came from. Between steps the weights lag one step behind
(they hold step k-1's update until the next forward or ``flush``).

Not supported (``ValueError`` at construction, see :func:`unsupported_reason`):
anything that needs every reduced gradient at once -- ``global_clipnorm``,
EMA (``use_ema``), loss scaling (``LossScaleOptimizer``'s finite check),
gradient accumulation. ``clipnorm`` and ``clipvalue`` act per gradient and are
exact. Sparse gradients (``IndexedSlices``) are sent dense.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence

import tensorflow as tf

from bps_tf.comm import async_training, collectives, naming
from bps_tf.overlap import guard as overlap_guard
from bps_tf.overlap.engine import DeferredApply, current_graph
from bps_tf.hooks import registry as hooks
from bps_tf.hooks import tf_internals
from bps_tf.hooks.entries import PrivateAttribute, defined_by
from bps_tf.hooks.roles import keras_class
from bps_tf.runtime import basics

log = logging.getLogger("bps_tf")

GROUP = "overlap.loop"
_LAYERS = ("OverlappedApply hooks the call of the layer that holds each variable, the "
           "deepest one; Keras lists a layer's own variables and its nested layers only "
           "privately")
OWN_VARIABLES = PrivateAttribute(
    "keras.Layer._trainable_variables", GROUP, keras_class("keras.Layer"),
    "_trainable_variables", ("weights",), "keras.Layer",
    changes="each variable is applied before the layer that holds it itself", why=_LAYERS,
    when_missing="error", feature="OverlappedApply")
hooks.probe("keras.Layer._flatten_layers", GROUP,
            defined_by(keras_class("keras.Layer"), "_flatten_layers", "keras.Layer"),
            changes="called to list a model's nested layers", why=_LAYERS,
            when_missing="error", feature="OverlappedApply")


def _stop_recording():
    """Keeps the deferred updates out of the user's GradientTape (nothing,
    with one warning, when this TensorFlow moved the way to)."""
    if not tf_internals.EAGER_RECORD.available():
        hooks.warn_fallback(GROUP, "OverlappedApply's deferred updates run inside the user's "
                                   "GradientTape (they are not differentiated)")
        import contextlib
        return contextlib.nullcontext()
    return tf_internals.EAGER_RECORD.stop_recording()


def unsupported_reason(optimizer) -> Optional[str]:
    """Why ``optimizer`` cannot be applied per layer exactly, or None."""
    if getattr(optimizer, "global_clipnorm", None):
        return "global_clipnorm needs the norm of all reduced gradients"
    return overlap_guard.needs_the_whole_step(optimizer)


def _own_variables(layer) -> list:
    return list(OWN_VARIABLES.get(layer, [], feature="OverlappedApply") or [])


class OverlappedApply(DeferredApply):
    """Deferred per-layer optimizer update with split push_pulls.

    ``model``: a built Keras model or layer; its layers (recursively) get a
    hook in front of ``call``. ``variables``: the variables trained (default
    ``model.trainable_variables``), in the order ``start`` receives their
    gradients; earlier ones get higher push_pull priority. Variables no
    layer owns directly are updated at the start of ``model``'s own call.
    ``prefix`` separates the keys of several instances (``naming.overlap_keys``);
    it must be the same on every worker. ``average``: divide the sums by the
    number of workers (as ``Average``) or not (``Sum``).
    ``allow_unverified_optimizer``: accept an optimizer type (a subclass, a
    third-party one) whose per-variable update is not verified exact; only
    for one whose update of a variable reads nothing but that variable, its
    slots, the learning rate and ``iterations`` (no state shared across
    variables, advanced once per ``apply``).
    """

    def __init__(self, model, optimizer, variables: Optional[Sequence] = None,
                 prefix: str = "default", average: bool = True,
                 allow_unverified_optimizer: bool = False):
        collectives.require_init()
        async_training.refuse_gradient_exchange("OverlappedApply")
        if basics.membership_epoch() is not None:
            raise NotImplementedError(
                "OverlappedApply under elastic training (BYTEPS_ELASTIC=1): each step's update "
                "is applied during the next step's forward pass, so a membership change finds "
                "an update half applied, which no commit holds. Use DistributedGradientTape "
                "(or the Keras DistributedOptimizer) with hvd.elastic.run.")
        reason = unsupported_reason(optimizer)
        if reason is not None:
            raise ValueError(f"OverlappedApply cannot defer this optimizer's update exactly: "
                             f"{reason}. Use DistributedGradientTape + optimizer.apply instead.")
        # An update that reads state shared by all variables (as Nadam's
        # schedule product) would silently change when applied per layer.
        unverified = overlap_guard.unverified_reason(optimizer)
        if unverified and not allow_unverified_optimizer:
            raise ValueError(f"OverlappedApply: {unverified}. Pass allow_unverified_optimizer=True "
                             f"if its update of a variable reads only that variable, its slots, "
                             f"the learning rate and iterations; else use "
                             f"DistributedGradientTape + optimizer.apply.")
        variables = list(model.trainable_variables if variables is None else variables)
        if not variables:
            raise ValueError("OverlappedApply: no trainable variables (build the model first).")
        super().__init__(variables, naming.overlap_keys(variables, prefix),
                         "OverlappedApply(prefix=" + repr(prefix) + ")")
        self.model = model
        self.optimizer = optimizer
        self.average = average
        if not optimizer.built:
            optimizer.build(self.variables)
        overlap_guard.install_flushes()
        hooks.require(overlap_guard.GROUP, "OverlappedApply", policy=None)
        hooks.require_entries([OWN_VARIABLES.name, "keras.Layer._flatten_layers"],
                              "OverlappedApply")
        self._install_hooks()
        # Reads between steps (an eager numpy(), a tf.function reading the
        # weights directly) apply the pending updates first.
        overlap_guard.watch(self.variables, overlap_guard.resource_handles(self.variables), self)

    # ------------------------------------------------------------------
    def _install_hooks(self):
        owner: Dict[int, object] = {}
        layers = [self.model]
        flatten = getattr(self.model, "_flatten_layers", None)   # a Keras layer's (an entry)
        if flatten is not None:
            layers += [l for l in flatten(include_self=False, recursive=True)]
        # Deepest owner wins: the layer whose own variables hold it.
        for layer in layers:
            for v in _own_variables(layer):
                if self.index_of(v) is not None:
                    owner[id(v)] = layer
        groups: Dict[int, List[int]] = {}
        by_id = {}
        for i, v in enumerate(self.variables):
            layer = owner.get(id(v), self.model)
            groups.setdefault(id(layer), []).append(i)
            by_id[id(layer)] = layer
        self.groups = [(by_id[k], idx) for k, idx in groups.items()]
        for layer, indices in self.groups:
            self.hook_call(layer, lambda indices=tuple(indices): self._apply(indices), self)

    def _apply(self, indices) -> int:
        """Waits for and applies the pending sums of ``indices``, outside
        the user's GradientTape."""
        with _stop_recording():
            return self.apply_pending(indices)

    def update(self, i, summed):
        # start() counted this step already; the update must see the count
        # of the step the gradient came from, and apply() adds it back.
        grad = collectives.divide(summed, basics.size()) if self.average else summed
        self.optimizer.iterations.assign_sub(1)
        self.optimizer.apply([grad], [self.variables[i]])

    # ------------------------------------------------------------------
    def start(self, grads, variables: Optional[Sequence] = None):
        """Starts the push_pulls of ``grads`` (one per variable, in the order
        of ``variables``, default the constructor's) and counts the step in
        ``optimizer.iterations``. Variables whose pending update no hook
        applied in this step are applied first. ``None`` gradients are
        skipped. Returns the start tokens."""
        variables = self.variables if variables is None else list(variables)
        grads = list(grads)
        if len(grads) != len(variables):
            raise ValueError(f"start: {len(grads)} gradients for {len(variables)} variables.")
        indices = []
        for v in variables:
            if self.index_of(v) is None:
                raise ValueError(f"start: variable {naming.variable_name(v)} is not one of "
                                 f"this OverlappedApply's variables.")
            indices.append(self.index_of(v))
        # Anything still pending under these keys must be applied before
        # the same keys are started again.
        self._apply(indices)
        graph = current_graph()
        if graph is not None:
            overlap_guard.mark_train_graph(graph, self)
        else:
            self.dirty = True
        updates = list(self.applied(graph).values()) if graph is not None else []
        chosen = [(i, tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g)
                  for i, g in zip(indices, grads) if g is not None]
        tokens = self.start_sums([i for i, _ in chosen], [g for _, g in chosen], lambda i: -i)
        with tf.control_dependencies(updates):
            self.optimizer.iterations.assign_add(1)
        return tokens

    def flush(self) -> int:
        """Waits for and applies every pending update. Returns how many
        variables were updated (eager; 0 when traced). A second flush is a
        no-op. Call it before evaluation, saving or reading the weights."""
        if tf.executing_eagerly():
            with self.step_lock.held():
                return self.flush_pending()
        # In a graph each key is applied once per graph; a flush must wait
        # again even for keys a hook already applied in this graph.
        done = self.applied(current_graph())
        for i in range(len(self.variables)):
            done.pop(i, None)
        self._apply(range(len(self.variables)))
        return 0
