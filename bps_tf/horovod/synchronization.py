"""Horovod's barrier, in-place ``broadcast_`` and the ``*_op`` rank queries.

* ``barrier()`` returns once every worker has called it (a push_pull of one
  int32 at the blocking priority, under ``Barrier/<name>``; unnamed eager
  barriers are numbered like the other unnamed eager calls).
* ``broadcast_(variables, root_rank)`` assigns ``root_rank``'s values to the
  variables in place (keys ``Broadcast_/<name or variable path>``).
* ``size_op``, ``rank_op``, ``local_size_op``, ``local_rank_op``,
  ``process_set_included_op``: int32 scalar tensors; inside a graph they
  are read when the graph runs (an elastic job's membership changes under
  traced graphs), a process set's size and inclusion stay fixed.
* ``join()``: a worker out of data joins; the others' reductions go on
  without it until every worker has joined (docs/engine.md, "Join").
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from bps_tf.comm import collectives, membership, naming
from bps_tf.comm.collectives import BLOCKING_PRIORITY, require_init
from bps_tf.runtime import basics, process_sets
from bps_tf.runtime.process_sets import global_process_set

__all__ = ["barrier", "broadcast_", "size_op", "rank_op", "local_size_op", "local_rank_op",
           "process_set_included_op", "join"]


def join(device=""):
    """Horovod's ``join``: this worker has run out of data.

    Blocks until every worker has called it and returns the rank that joined
    last (the same int on every worker). Meanwhile the other workers'
    allreduces (every op, e.g. the gradients of DistributedGradientTape or
    DistributedOptimizer) complete with this worker counted as contributing
    zeros; an Average still divides by ``size()``, as in Horovod. A
    broadcast or allgather while a worker has joined fails on the workers
    that call it, as Horovod refuses them. Afterwards every collective runs
    normally again and workers may join again (next epoch). Eagerly it
    returns an int; inside a ``tf.function`` or a TF1 graph an int32 scalar
    tensor, and the join happens when that op runs (in a ``tf.function``
    after the function's earlier collectives, which it is ordered after).
    ``device`` is accepted for compatibility."""
    del device
    require_init()
    if tf.executing_eagerly():
        return int(basics.core().join())
    # A py_function: the join blocks until every worker has joined, and the
    # core releases the GIL while it waits. The push_pull ops are async
    # stateful (tf.function does not chain them in program order), so the
    # join depends on each collective traced before it in this graph.
    before = collectives.collective_ops(tf.compat.v1.get_default_graph())
    with tf.control_dependencies(before):
        joined = tf.py_function(lambda: np.int32(basics.core().join()), [], tf.int32,
                                name="BytePSJoin")
    joined.set_shape([])
    return joined


def barrier(name=None, process_set=global_process_set):
    """Blocks until every worker reaches the barrier. In eager mode it
    returns None once all have arrived; inside a tf.function it returns a
    tensor (the number of workers) that later ops can depend on."""
    ps = process_sets.resolve(process_set, "barrier")
    require_init()
    if name is None and not tf.executing_eagerly():
        name = "barrier"
    key = naming.op_key("Barrier", name, None, ps.key_id)
    with collectives.agreement_scope(set=process_sets.set_agreement(ps)), \
            collectives.membership_free():
        arrived = collectives.push_pull_sum(tf.ones([1], tf.int32), key, BLOCKING_PRIORITY)
    if tf.executing_eagerly():
        count = int(arrived.numpy()[0])
        if count != ps.size():
            raise RuntimeError(f"barrier {key}: {count} of {ps.size()} workers arrived")
        return None
    return tf.reshape(arrived, [])


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Assigns ``root_rank``'s values to ``variables`` (one variable or a
    list) in place on every worker and returns them (eager) or the assigned
    values (inside a tf.function). Keys come from ``name`` and the variables'
    paths, so every worker must pass the same variables in the same order."""
    ps = process_sets.resolve(process_set, "broadcast_")
    require_init()
    root_rank = collectives.check_root(root_rank)
    if ps.ranks is not None and root_rank not in ps.ranks:
        raise ValueError(f"broadcast_: root_rank {root_rank} is not in {ps!r} (a global rank).")
    single = isinstance(variables, tf.Variable) or not isinstance(variables, (list, tuple))
    targets = [variables] if single else list(variables)
    prefix = "Broadcast_" if name is None else f"Broadcast_/{name}"
    keys = naming.unique_names([f"{prefix}/{naming.variable_name(v)}" for v in targets])

    def assign_all():
        out = []
        with collectives.agreement_scope(set=process_sets.set_agreement(ps)), \
                collectives.membership_free():
            for priority, (var, key) in enumerate(zip(targets, keys)):
                value = collectives.broadcast(tf.convert_to_tensor(var), key, root_rank,
                                              priority=-priority)
                out.append(var.assign(value, read_value=True))
        return out

    if tf.executing_eagerly():
        # One function: the broadcasts overlap instead of running one by one.
        tf.function(assign_all, autograph=False)()
        return targets[0] if single else targets
    assigned = assign_all()
    return assigned[0] if single else assigned


def _query_op(query: str, name, fixed=None):
    """An int32 scalar tensor: eagerly the value now; in a graph an op that
    reads this worker's ``query`` ('rank', 'size', ...) when the graph runs,
    so a traced function sees the membership it runs in (elastic jobs).
    ``fixed``: a value that does not change with the membership."""
    require_init()
    if fixed is not None or tf.executing_eagerly():
        value = fixed if fixed is not None else getattr(basics, query)()
        return tf.constant(int(value), dtype=tf.int32, name=name)
    return tf.identity(getattr(membership, query)(), name=name)


def size_op(process_set_id=0, name=None):
    """The number of workers (of the registered process set
    ``process_set_id``), as an int32 scalar tensor read when it runs."""
    ps = process_sets.process_set_by_id(process_set_id)
    return _query_op("size", name, None if ps.ranks is None else ps.size())


def process_set_included_op(process_set_id=0, name=None):
    """1 if this worker belongs to the registered process set
    ``process_set_id``, else 0, as an int32 scalar tensor (Horovod's)."""
    ps = process_sets.process_set_by_id(process_set_id)
    return _query_op("size", name, int(bool(ps.included())))


def rank_op(name=None):
    """This worker's rank, as an int32 scalar tensor read when it runs."""
    return _query_op("rank", name)


def local_size_op(name=None):
    """The number of workers on this machine, as an int32 scalar tensor read when it runs."""
    return _query_op("local_size", name)


def local_rank_op(name=None):
    """This worker's rank on its machine, as an int32 scalar tensor read when it runs."""
    return _query_op("local_rank", name)
