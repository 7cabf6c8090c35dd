"""Allgather, broadcast and the object exchanges, for every face.

Horovod's semantics (``bps_tf.horovod`` re-exports these under its names,
and ``BytePSStrategy``, the checkpoint hooks and the TF1 glue use them too):

* :func:`allgather` -- rows of every worker in rank order; the first
  dimension may differ between workers, the others must agree; exact for
  every supported dtype except that a float -0.0 comes back as +0.0;
* :func:`broadcast` -- the root's value; :func:`broadcast_variables` assigns
  it to variables in place (all in one ``tf.function``, so they overlap);
* :func:`broadcast_object` / :func:`allgather_object` -- any picklable
  object, as pickled bytes.

Inside a traced function the rank and size that place this worker's rows are
read when the graph runs (bps_tf.comm.membership), so a graph traced in one
membership of an elastic job stays right in the next; a process set's
collectives carry the membership epoch instead (its ranks are fixed).
"""
from __future__ import annotations

import pickle

import numpy as np
import tensorflow as tf

from bps_tf.comm import async_training, collectives, membership, naming
from bps_tf.comm.collectives import require_init
from bps_tf.comm.naming import variable_name
from bps_tf.runtime import basics, process_sets
from bps_tf.runtime.process_sets import global_process_set

__all__ = ["allgather", "broadcast", "broadcast_variables", "broadcast_object",
           "broadcast_object_fn", "allgather_object", "check_set_root", "gather_rows"]


def gather_rows(tensor, key: str, *, process_set=None, priority: int = 0,
                average_gradient: bool = False, key_per_size: bool = False):
    """Rows of ``tensor`` from every worker of ``process_set`` (default: all),
    in rank order, under ``key``; returns ``(rows, [push_pull ops])``.
    ``average_gradient``: Horovod's allgather gradient (this rank's rows of
    the average of the gradients). ``key_per_size``: see collectives.allgather."""
    ps = process_set or global_process_set
    rank, size = membership.in_set(ps)
    if average_gradient:
        tensor = collectives.scale_gradient(
            tensor, lambda: 1.0 / tf.cast(membership.set_size(ps), tf.float64))
    with collectives.agreement_scope(set=process_sets.set_agreement(ps), op=""), \
            collectives.membership_free():
        return collectives.allgather(tensor, key, rank, size, priority, widen=True,
                                     key_per_size=key_per_size)


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set,
              same_shape=True, scope=""):
    """Concatenates ``tensor`` over workers along the first dimension, in
    rank order. The first dimension may differ between workers; the others
    must agree. Exact for every supported dtype, except that a float -0.0
    comes back as +0.0 (see ``bps_tf.comm.collectives.allgather``). BytePS's
    ``same_shape`` and ``scope`` are accepted (first dimensions may differ
    either way).
    """
    ps = process_sets.resolve(process_set, "allgather")
    del ignore_name_scope, same_shape, scope
    require_init()
    tensor = collectives.row_tensor(tensor, "allgather", collectives.GATHER_DTYPES)
    key = naming.op_key("Allgather", name, tensor, ps.key_id)
    # Horovod's gradient: this rank's rows of the *average* of the gradients.
    gathered, _ = gather_rows(tensor, key, process_set=ps, average_gradient=True)
    return gathered


# --------------------------------------------------------------------------
# broadcast
# --------------------------------------------------------------------------
def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set, scope="", is_variable=True):
    """Every worker gets ``root_rank``'s value of ``tensor``. With a
    ``process_set``, ``root_rank`` is a global rank in the set (as in Horovod).
    BytePS's ``scope`` and ``is_variable`` are accepted (names come from
    ``name`` or the tensor)."""
    del scope, is_variable
    ps = process_sets.resolve(process_set, "broadcast")
    del ignore_name_scope
    require_init()
    root_rank = check_set_root(root_rank, ps)
    tensor = tf.convert_to_tensor(tensor)
    key = naming.op_key("Broadcast", name, tensor, ps.key_id)
    # Horovod's gradient: the root gets the average of the gradients.
    tensor = collectives.scale_gradient(
        tensor, lambda: 1.0 / tf.cast(membership.set_size(ps), tf.float64))
    with collectives.agreement_scope(set=process_sets.set_agreement(ps), op=""), \
            collectives.membership_free():
        return collectives.broadcast(tensor, key, root_rank)


def check_set_root(root_rank, ps):
    """``root_rank`` checked: a global rank, and a member of ``ps``."""
    root_rank = collectives.check_root(root_rank)
    if ps.ranks is not None and root_rank not in ps.ranks:
        raise ValueError(f"root_rank {root_rank} is not in {ps!r} (root_rank is a global "
                         "rank, as in Horovod).")
    return root_rank


def broadcast_variables(variables, root_rank=0, process_set=global_process_set, scope=""):
    """Assigns ``root_rank``'s values to ``variables`` in place, on every worker.

    All broadcasts run inside one ``tf.function`` so they overlap (100
    variables cost about one round trip, not 100). Names come from each
    variable's Keras 3 ``.path`` (or ``.name``), so workers must build the
    same variables under the same names. In a TF1 graph it returns the op
    that does it (run it in the session). Under BYTEPS_ENABLE_ASYNC=1 the
    trainable ones are also written into the servers' store
    (bps_tf.comm.async_training.start_from_root; eager calls only). BytePS's
    ``broadcast_variables(variables, root_rank, scope)`` runs too.
    """
    if isinstance(process_set, str):  # BytePS's third argument is a name scope
        process_set, scope = global_process_set, process_set
    del scope
    ps = process_sets.resolve(process_set, "broadcast_variables")
    require_init()
    root_rank = check_set_root(root_rank, ps)
    variables = list(variables)
    if not variables:
        return
    keys = naming.unique_names(["BroadcastVariables/" + variable_name(v) for v in variables])

    def assign_all():
        assigns = []
        with collectives.agreement_scope(set=process_sets.set_agreement(ps), op=""), \
                collectives.membership_free():
            for priority, (var, key) in enumerate(zip(variables, keys)):
                value = collectives.broadcast(tf.convert_to_tensor(var), key, root_rank,
                                              priority=-priority)
                assigns.append(var.assign(value))
        return tf.group(*assigns)

    if tf.executing_eagerly():
        def run():
            assign_all()  # a tf.function may not return the op that groups them
        tf.function(run, autograph=False)()
        if async_training.enabled():
            # Asynchronous training: the servers' copy starts from the root's too.
            async_training.start_from_root(
                [v for v in variables if getattr(v, "trainable", False)], root_rank)
    else:
        # A TF1 graph: the op a session runs (Horovod's broadcast_variables
        # returns it too).
        return assign_all()


def _object_value(tensor, session, where):
    """The numpy value of ``tensor``: eagerly, or run in ``session`` (else
    the default session) inside a TF1 graph, as Horovod's object calls do."""
    if tf.executing_eagerly():
        return tensor.numpy()
    session = session or tf.compat.v1.get_default_session()
    if session is None:
        raise RuntimeError(f"{where} in a graph needs a session: pass session= or run it "
                           f"under a default session (or call it eagerly).")
    return session.run(tensor)


def broadcast_object(obj, root_rank=0, session=None, name=None,
                     process_set=global_process_set):
    """Returns ``root_rank``'s ``obj`` on every worker (any picklable object).

    The pickled bytes travel as int32 words; their length is broadcast first
    so the other workers can size the buffer. In a TF1 graph the collectives
    run in ``session`` (default: the default session), as in Horovod.
    """
    ps = process_sets.resolve(process_set, "broadcast_object")
    require_init()
    root_rank = check_set_root(root_rank, ps)
    with collectives.agreement_scope(set=process_sets.set_agreement(ps), op=""):
        return _broadcast_object(obj, root_rank, naming.op_key("BroadcastObject", name, None,
                                                               ps.key_id), session)


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """Horovod's: a function ``f(obj)`` returning ``root_rank``'s ``obj`` on
    every worker, for calling many times (every worker calls it alike); in a
    TF1 graph it runs in ``session``, as :func:`broadcast_object`."""
    name = name or "broadcast_object_fn"

    def broadcast_one(obj):
        return broadcast_object(obj, root_rank, session=session, name=name,
                                process_set=process_set)
    return broadcast_one


def _broadcast_object(obj, root_rank, base, session=None):
    is_root = basics.rank() == root_rank
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if is_root else b""
    length = collectives.broadcast(tf.constant([len(payload)], tf.int64),
                                   naming.part_key(base, "length"), root_rank)
    nbytes = int(_object_value(length, session, "broadcast_object")[0])
    words = (nbytes + 3) // 4
    if is_root:
        padded = payload + b"\0" * (words * 4 - nbytes)
        buf = np.frombuffer(padded, dtype=np.int32).copy()
    else:
        buf = np.zeros([words], np.int32)
    data = collectives.broadcast(tf.constant(buf), naming.part_key(base, "data"), root_rank)
    return pickle.loads(_object_value(data, session, "broadcast_object").tobytes()[:nbytes])


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every worker's ``obj`` (any picklable object), as a list in rank order.

    The pickled bytes travel as uint8 rows of an allgather (first dimension
    may differ per worker), after an allgather of their lengths. In a TF1
    graph they run in ``session`` (default: the default session).
    """
    ps = process_sets.resolve(process_set, "allgather_object")
    require_init()
    base = naming.op_key("AllgatherObject", name, None, ps.key_id)
    payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    lengths = _object_value(allgather(tf.constant([payload.size], tf.int64),
                                      name=naming.part_key(base, "lengths"), process_set=ps),
                            session, "allgather_object")
    data = _object_value(allgather(tf.constant(payload), name=naming.part_key(base, "data"),
                                   process_set=ps), session, "allgather_object")
    out, start = [], 0
    for length in lengths:
        out.append(pickle.loads(data[start:start + int(length)].tobytes()))
        start += int(length)
    return out
