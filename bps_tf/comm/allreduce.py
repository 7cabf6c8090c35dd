"""Horovod's allreduce and the gradient reduction, for every face that needs them.

:func:`allreduce` is Horovod's ``allreduce``/``push_pull`` once its arguments
are read (``bps_tf.horovod.api`` reads BytePS's and Horovod's argument
forms and calls it): a named request of :mod:`bps_tf.comm.reduction`.
:func:`reduce_gradients` reduces a list of gradients named after their
variables: the gradient path of ``DistributedGradientTape``, the Keras
``DistributedOptimizer`` and the TF1 optimizer of ``bps_tf.compat``.

Names (bps_tf.comm.naming): ``PushPull/<name>`` for every reduce op (Min,
Max and Product are told apart by the op's ``reduce_op``); an
``IndexedSlices`` is two allgathers ``Allgather/<name>/values`` and
``Allgather/<name>/indices``.
"""
from __future__ import annotations

import tensorflow as tf

from bps_tf.comm import async_training, collectives, fingerprint, naming
from bps_tf.comm.reduction import Average, Reduction
from bps_tf.runtime import process_sets
from bps_tf.runtime.process_sets import global_process_set

__all__ = ["allreduce", "reduce_gradients"]


def allreduce(tensor, name=None, op=Average, compression=None, priority=0,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
              device_dense="", device_sparse=""):
    """``tensor`` (dense or ``IndexedSlices``) reduced over the workers of
    ``process_set`` by ``op`` (a ReduceOp), named ``name`` (derived from the
    tensor when None, see bps_tf.comm.naming)."""
    ps = process_sets.resolve(process_set, "push_pull")
    collectives.require_init()
    options = dict(compression=compression, prescale=prescale_factor,
                   postscale=postscale_factor, priority=priority, process_set=ps)
    if isinstance(tensor, tf.IndexedSlices):
        key = naming.op_key("Allgather", naming.sparse_base(name, tensor, ps.key_id),
                            tensor, ps.key_id)
        with tf.device(device_sparse):
            return Reduction(key, op, **options).sparse(tensor, horovod=True)
    tensor = tf.convert_to_tensor(tensor)
    collectives.check_dtype(tensor, "push_pull", collectives.REDUCE_DTYPES)
    with tf.device(device_dense):
        return Reduction(naming.op_key("PushPull", name, tensor, ps.key_id), op,
                         **options).dense(tensor)


def reduce_gradients(grads, sources, prefix, compression=None, sparse_as_dense=False,
                     op=Average, priority_fn=None, postscale_factor=1.0, prescale_factor=1.0,
                     process_set=global_process_set):
    """Reduces a list of gradients named after their ``sources``.

    Priority is ``-index`` by default: earlier sources are needed earlier
    in the next forward pass; inside a graph the C++ priority pass replaces
    it with the order the graph reads the variables in. ``priority_fn(index,
    source)`` chooses instead, and the pass keeps its choice.
    ``None`` gradients pass through, and so does every gradient of a worker
    outside ``process_set`` or alone in it (Horovod's rule).
    """
    async_training.refuse_gradient_exchange(prefix)
    ps = process_sets.resolve(process_set, prefix, members_only=False)
    if not process_sets.reduces_over(ps):
        return list(grads)
    names = naming.unique_names([f"{prefix}/{naming.source_name(s, i)}"
                                 for i, s in enumerate(sources)])
    out = []
    for index, (grad, source, name) in enumerate(zip(grads, sources, names)):
        if grad is None:
            out.append(None)
            continue
        if sparse_as_dense and isinstance(grad, tf.IndexedSlices):
            grad = tf.convert_to_tensor(grad)
        priority = -index if priority_fn is None else int(priority_fn(index, source))
        with collectives.keep_priority(priority_fn is not None):
            out.append(allreduce(grad, name=name, op=op, compression=compression,
                                 priority=priority, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, process_set=process_set))
    if ps.ranks is not None:
        return out     # a process set's members only: the fingerprint table spans all
    # Every N steps: the variables must still be the same on every worker.
    trained = [s for s, g in zip(sources, grads) if g is not None and hasattr(s, "assign")]
    return fingerprint.checked(out, trained, prefix, f"{prefix} gradients")
