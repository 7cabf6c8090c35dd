"""bps_tf for ``tf.compat.v1`` graphs and sessions, shaped like Horovod's:

    opt = bps_tf.DistributedOptimizer(tf.compat.v1.train.AdamOptimizer(1e-3))
    train = opt.minimize(loss)

``compute_gradients`` averages (or sums) every gradient across workers
before ``apply_gradients`` uses it: dense gradients through push_pull,
``IndexedSlices`` (an embedding lookup's gradient) gathered exactly, values
and indices, so sparse optimizer updates see every worker's rows. Names come
from the variables (the same on every worker that builds the same graph);
priorities are set by the C++ priority pass when the session runs the graph.

Or, with no change to the training script but one line,
``bps_tf.compat.v1.enable_graph_rewrite()`` before the session is created:
the pass then inserts a push_pull between every dense gradient and the
``Apply*``/``ResourceApply*`` op applying it, in every graph a TF1 session
runs, and gathers sparse gradients (embedding lookups) exactly; a sparse update
it cannot trace to tf.gradients' output is refused with an error naming the op
(wrap the optimizer instead).
"""
from __future__ import annotations

import tensorflow as tf

from bps_tf.comm import allreduce as allreduce_lib
from bps_tf.comm import async_training, collectives, reduction
from bps_tf.comm.compression import Compression
from bps_tf.compat.pass_aggregation import PassAggregator, passes_count
from bps_tf.runtime import basics, process_sets

_V1Optimizer = tf.compat.v1.train.Optimizer


class DistributedOptimizer(_V1Optimizer):
    """Wraps a ``tf.compat.v1.train.Optimizer``; see the module docstring.

    ``name`` prefixes the push_pull names (default ``DistributedOptimizer``);
    ``op`` is ``bps_tf.Average`` (default) or ``bps_tf.Sum``;
    ``sparse_as_dense`` turns ``IndexedSlices`` into dense tensors first.
    ``gradient_predivide_factor`` (with ``op=Average``) divides by the factor
    before the sum and by ``size / factor`` after it, as in Horovod.
    ``backward_passes_per_step=N`` sums N batches' gradients locally and
    exchanges once: ``compute_gradients`` returns the reduced sums on every
    N-th run, and ``apply_gradients`` applies only then (on the other runs it
    advances ``global_step`` alone, so it counts batches). The N passes are
    summed unless ``average_aggregated_gradients``. Its sums are
    LOCAL_VARIABLES: run ``tf.compat.v1.local_variables_initializer()``
    (``MonitoredTrainingSession`` does), as with Horovod.
    ``device_dense``/``device_sparse`` are accepted for compatibility.
    """

    def __init__(self, optimizer, name=None, use_locking=False, device_dense="",
                 device_sparse="", compression=Compression.none, sparse_as_dense=False,
                 op=reduction.Average, priority_fn=None, process_set=process_sets.global_process_set,
                 gradient_predivide_factor=1.0, backward_passes_per_step=1,
                 average_aggregated_gradients=False):
        if not isinstance(optimizer, _V1Optimizer):
            raise TypeError("bps_tf.compat.v1.DistributedOptimizer wraps a "
                            f"tf.compat.v1.train.Optimizer, got {type(optimizer).__name__}.")
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("this optimizer is already a DistributedOptimizer.")
        super().__init__(use_locking=use_locking,
                         name=f"Distributed{type(optimizer).__name__}")
        del device_dense, device_sparse
        process_sets.resolve(process_set, "DistributedOptimizer", members_only=False)
        self._optimizer = optimizer
        op = reduction.resolve_op(None, op)
        prescale, postscale = reduction.predivide_scales(op, gradient_predivide_factor,
                                                   "DistributedOptimizer")
        passes = passes_count(backward_passes_per_step)
        self._prefix = name or "DistributedOptimizer"
        self._bps = dict(compression=compression,
                         sparse_as_dense=bool(sparse_as_dense), op=op,
                         priority_fn=priority_fn, process_set=process_set,
                         prescale_factor=prescale, postscale_factor=postscale)
        # Horovod's name for the helper that sums the passes.
        self._agg_helper = (PassAggregator(passes, average_aggregated_gradients, graph_local=True)
                            if passes > 1 else None)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's (gradient, variable) pairs, each gradient
        reduced across workers (``None`` gradients stay ``None``)."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return pairs
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        if self._agg_helper is not None:
            reduced = self._agg_helper.reduce(grads, variables, self._reduce)
        else:
            reduced = self._reduce(grads, variables)
        return list(zip(reduced, variables))

    def _reduce(self, grads, variables):
        return allreduce_lib.reduce_gradients(grads, variables, self._prefix, **self._bps)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The wrapped optimizer's update; with ``backward_passes_per_step``
        > 1 only on the runs whose gradients were exchanged."""
        if self._agg_helper is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                   name=name)
        grads_and_vars = list(grads_and_vars)
        ready = self._agg_helper.ready([g for g, _ in grads_and_vars if g is not None])

        def apply():
            with tf.control_dependencies([self._optimizer.apply_gradients(
                    grads_and_vars, global_step=global_step, name=name)]):
                return tf.constant(True)

        def count_only():
            if global_step is None:
                return tf.constant(False)
            with tf.control_dependencies([global_step.assign_add(1)]):
                return tf.constant(False)

        applied = tf.cond(ready, apply, count_only)
        return applied if tf.executing_eagerly() else tf.group(applied)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


def enable_graph_rewrite(average: bool = True) -> None:
    """From now on, graphs run by TF1 sessions (not tf.function) get a
    push_pull between each dense gradient and the optimizer op applying it,
    averaged over the workers unless ``average=False``; priorities from the
    graph. Call after ``bps_tf.init()`` and before creating the session: a
    session rewrites its graph when it first runs it."""
    if not basics.is_initialized():
        raise RuntimeError("call bps_tf.init() before bps_tf.compat.v1.enable_graph_rewrite()")
    async_training.refuse_gradient_exchange("bps_tf.compat.v1.enable_graph_rewrite")
    collectives.configure_graph_rewrite(True, basics.size(), basics.rank(), average)


def disable_graph_rewrite() -> None:
    """Sessions created from now on run their graphs as built."""
    collectives.configure_graph_rewrite(False)


def is_v1_optimizer(optimizer) -> bool:
    return isinstance(optimizer, _V1Optimizer)
