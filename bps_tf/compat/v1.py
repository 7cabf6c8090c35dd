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

from bps_tf import api, async_training, basics, collectives, process_sets

_V1Optimizer = tf.compat.v1.train.Optimizer


class DistributedOptimizer(_V1Optimizer):
    """Wraps a ``tf.compat.v1.train.Optimizer``; see the module docstring.

    ``name`` prefixes the push_pull names (default ``DistributedOptimizer``);
    ``op`` is ``bps_tf.Average`` (default) or ``bps_tf.Sum``;
    ``sparse_as_dense`` turns ``IndexedSlices`` into dense tensors first.
    ``device_dense``/``device_sparse`` are accepted for compatibility.
    """

    def __init__(self, optimizer, name=None, use_locking=False, device_dense="",
                 device_sparse="", compression=api.Compression.none, sparse_as_dense=False,
                 op=api.Average, priority_fn=None, process_set=process_sets.global_process_set):
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
        self._bps = dict(prefix=name or "DistributedOptimizer", compression=compression,
                         sparse_as_dense=bool(sparse_as_dense), op=api.resolve_op(None, op),
                         priority_fn=priority_fn, process_set=process_set)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's (gradient, variable) pairs, each gradient
        reduced across workers (``None`` gradients stay ``None``)."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return pairs
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        opts = self._bps
        reduced = api.reduce_gradients(grads, variables, opts["prefix"],
                                       compression=opts["compression"],
                                       sparse_as_dense=opts["sparse_as_dense"], op=opts["op"],
                                       priority_fn=opts["priority_fn"],
                                       process_set=opts["process_set"])
        return list(zip(reduced, variables))

    def apply_gradients(self, *args, **kwargs):
        return self._optimizer.apply_gradients(*args, **kwargs)

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
