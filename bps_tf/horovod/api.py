"""The Horovod/BytePS-style TensorFlow API, built on ``bps_tf.comm.collectives``.

* ``push_pull`` / ``allreduce``: sum, then average (``op=Average``, the default).
* ``allgather``: rows of every worker, concatenated in rank order.
* ``broadcast`` / ``broadcast_variables`` / ``broadcast_object``.
* ``reduce_gradients``: the gradient reduction behind
  ``DistributedGradientTape`` (``bps_tf.horovod.tape``) and the Keras
  ``DistributedOptimizer``.

Names. Workers match tensors by name, so every worker must give the same
tensor the same name: an explicit ``name=`` always wins; inside a
``tf.function`` the name comes from the tensor's op name; unnamed eager calls
are numbered, so they must happen in the same order on every worker. The
name given to the op carries a family prefix (``PushPull/``, ``Broadcast/``,
``Allgather/`` ...) so that, say, a broadcast and a push_pull named ``w``
never meet on one key. The whole contract is in ``bps_tf.comm.naming``.

Averages. Floating tensors are divided by ``size()``. Integer tensors are
floor-divided (``tf.math.floordiv``), which keeps their dtype: the average of
3 and 4 over 2 workers is 3, of -3 and -4 is -4.
"""
from __future__ import annotations

import enum
import pickle

import numpy as np
import tensorflow as tf

from bps_tf.comm import async_training, collectives, fingerprint
from bps_tf.comm import compression as compression_lib
from bps_tf.comm import naming
from bps_tf.comm.collectives import SUPPORTED_DTYPES, require_init
from bps_tf.comm.compression import Compression, Compressor, FP16Compressor, NoneCompressor
from bps_tf.comm.naming import variable_name
from bps_tf.runtime import basics, process_sets
from bps_tf.runtime.process_sets import global_process_set

__all__ = [
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "Compression", "Compressor", "NoneCompressor", "FP16Compressor",
    "push_pull", "allreduce", "grouped_allreduce", "allgather", "broadcast",
    "broadcast_variables", "broadcast_object", "allgather_object", "reduce_gradients",
    "predivide_scales", "resolve_op",
    "variable_name", "SUPPORTED_DTYPES", "SERVER_OPS", "sum_exact",
]


# --------------------------------------------------------------------------
# Reduce ops and compression
# --------------------------------------------------------------------------
class ReduceOp(enum.IntEnum):
    AVERAGE = 0
    SUM = 1
    # Adasum has no parameter-server equivalent: it exists so that code
    # written for Horovod imports, and fails clearly where used. Min, Max
    # and Product are computed by the servers, like the sum.
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT


# --------------------------------------------------------------------------
# Reduce op
# --------------------------------------------------------------------------
def resolve_op(average, op):
    """The ReduceOp of a call given Horovod's ``op`` or deprecated ``average``."""
    if average is not None and op is not None:
        raise ValueError("push_pull/allreduce: give either `op` or the deprecated "
                         "`average`, not both.")
    if op is None:
        op = Sum if average is False else Average
    try:   # BytePS names its ops with strings: "Average", "Sum", "Adasum"
        op = ReduceOp[op.upper()] if isinstance(op, str) else ReduceOp(op)
    except (KeyError, ValueError):
        raise ValueError(f"unknown reduce op {op!r}: expected Average, Sum, Min, Max or "
                         "Product.") from None
    if op == Adasum:
        raise NotImplementedError(
            "reduce op ADASUM is not available in bps_tf (a parameter server "
            "sums); use Average, Sum, Min, Max or Product.")
    return op


# Reduce ops the servers compute besides the sum: op -> kind of
# bps_tf.comm.collectives.reduce_on_servers. They share the sum's key family, so
# ranks that pass different ops under one name fail (the op is declared with
# the shape) instead of waiting for each other under different keys.
SERVER_OPS = {Min: "min", Max: "max", Product: "product"}


# --------------------------------------------------------------------------
# push_pull / allreduce
# --------------------------------------------------------------------------
def push_pull(tensor, average=None, name=None, compression=Compression.none,
              op=None, priority=0, device_dense="", device_sparse="",
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
              scope="", enable_async=False):
    """Reduces ``tensor`` across all workers (``op=Average`` by default).

    ``Sum``/``Average`` go through the servers' sum; ``Min``, ``Max`` and
    ``Product`` are computed exactly by the servers too, in the tensor's
    dtype (not with compression or in asynchronous training).

    ``prescale_factor`` multiplies before the sum, ``postscale_factor`` after
    the average. ``priority``: higher leaves first. An ``IndexedSlices`` is
    gathered (its values and indices concatenated over workers, values divided
    by ``size()`` for Average), as Horovod does.

    ``process_set``: a registered ProcessSet; only its members take part
    (and call this), the average divides by its size. Workers that pass
    different ops or sets under one name all fail, naming both.

    BytePS's ``push_pull(tensor, scope, average, ...)`` runs too: a string
    in the second place is its ``scope`` (names come from ``name`` or the
    tensor, so the scope is not needed for them); ``enable_async=True`` is
    refused, since asynchronous training here pushes weight deltas
    (``BytePSStrategy(mode="async")`` or ``BYTEPS_ENABLE_ASYNC=1`` with
    ``DistributedOptimizer``), not gradients through this call.
    """
    if isinstance(average, str):  # BytePS's positional order: (tensor, scope, average)
        scope, average = average, None
    del scope
    if enable_async:
        raise NotImplementedError(
            "push_pull(enable_async=True): asynchronous training pushes weight deltas, not "
            "gradients through push_pull; use BytePSStrategy(mode='async') or "
            "BYTEPS_ENABLE_ASYNC=1 with bps_tf.keras.DistributedOptimizer (docs/strategy.md).")
    ps = process_sets.resolve(process_set, "push_pull")
    require_init()
    op = resolve_op(average, op)
    with collectives.agreement_scope(set=process_sets.set_agreement(ps), op=op.name.lower()):
        return _push_pull(tensor, name, compression, op, priority, device_dense,
                          device_sparse, prescale_factor, postscale_factor, ps)


def _push_pull(tensor, name, compression, op, priority, device_dense, device_sparse,
               prescale_factor, postscale_factor, ps):
    if isinstance(tensor, tf.IndexedSlices):
        if op in SERVER_OPS:
            raise NotImplementedError(f"push_pull of an IndexedSlices takes Sum or Average, "
                                      f"not {op.name}.")
        with tf.device(device_sparse):
            return _push_pull_sparse(tensor, name, op, prescale_factor,
                                     postscale_factor, ps)
    tensor = tf.convert_to_tensor(tensor)
    collectives.check_dtype(tensor, "push_pull", collectives.REDUCE_DTYPES)
    size = ps.size()
    with tf.device(device_dense):
        sent = collectives.scale(tensor, prescale_factor, "prescale_factor")
        if op in SERVER_OPS:
            kind = SERVER_OPS[op]
            if compression is not Compression.none and compression is not NoneCompressor:
                raise ValueError(f"push_pull: op={op.name.title()} takes no compression "
                                 f"(a compressor approximates a sum); use Compression.none.")
            if async_training.enabled():
                raise NotImplementedError(
                    f"push_pull: op={op.name.title()} is not available in asynchronous "
                    f"training (BYTEPS_ENABLE_ASYNC=1: the servers keep running sums, not "
                    f"rounds); use op=Sum or Average, or synchronous training.")
            result = collectives.reduce_on_servers(
                sent, naming.op_key("PushPull", name, tensor, ps.key_id), kind, priority)
            return collectives.scale(result, postscale_factor, "postscale_factor")
        key = naming.op_key("PushPull", name, tensor, ps.key_id)
        if compression is FP16Compressor and sent.dtype in (tf.float32, tf.float64):
            # Scaled so that no sum overflows float16 (a plain cast would).
            result = collectives.push_pull_sum_fp16(sent, key, priority)
            if op == Average:
                result = collectives.divide(result, size)
        elif compression_lib.is_core(compression):
            # The engine compresses each partition; summing compress()'s bytes would be wrong.
            result = sum_exact(sent, key, op, priority, compression_lib.core_spec(compression),
                               size=size)
        else:
            sent, ctx = compression.compress(sent)
            result = compression.decompress(sum_exact(sent, key, op, priority, size=size), ctx)
        return collectives.scale(result, postscale_factor, "postscale_factor")


def sum_exact(tensor, key, op, priority=0, compression="", size=None):
    """Sum (or average, ``op``) of ``tensor`` over workers under ``key``
    (``size``: how many take part, by default every worker).

    Narrow integers (int8, uint8, int16, uint16) travel as int32: their sum
    comes back wrapped as the type wraps; their average is the floor of the
    exact mean (taken before narrowing, so it never wraps).
    """
    dtype = tensor.dtype
    size = basics.size() if size is None else size
    wide = collectives.WIDEN.get(dtype) if dtype in collectives.REDUCE_DTYPES else None
    if wide is None:
        summed = collectives.push_pull_sum(tensor, key, priority, compression=compression)
        return collectives.divide(summed, size) if op == Average else summed
    summed = collectives.push_pull_sum(tf.cast(tensor, wide), key, priority)
    if op == Average:
        summed = collectives.divide(summed, size)
    return tf.cast(summed, dtype)


def _push_pull_sparse(slices, name, op, prescale_factor, postscale_factor, ps):
    base = naming.sparse_base(name, slices, ps.key_id)
    values = collectives.scale(slices.values, prescale_factor, "prescale_factor")
    values = allgather(values, name=naming.part_key(base, "values"), process_set=ps)
    indices = allgather(slices.indices, name=naming.part_key(base, "indices"), process_set=ps)
    if op == Average:   # Horovod's true division: integer values average to floats
        values = values / ps.size()
    values = collectives.scale(values, postscale_factor, "postscale_factor")
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, name=None, ignore_name_scope=False,
              priority=0, process_set=global_process_set):
    """``push_pull`` under Horovod's name and argument order.
    ``ignore_name_scope`` is accepted for compatibility and has no effect.
    As in Horovod, an ``IndexedSlices`` takes no pre/postscaling here
    (``NotImplementedError``; ``push_pull`` scales its values)."""
    del ignore_name_scope
    if isinstance(tensor, tf.IndexedSlices) and (prescale_factor != 1.0 or
                                                 postscale_factor != 1.0):
        raise NotImplementedError("allreduce: pre/postscaling is not supported with "
                                  "tf.IndexedSlices (as in Horovod).")
    return push_pull(tensor, average=average, name=name, compression=compression,
                     op=op, priority=priority, device_dense=device_dense,
                     device_sparse=device_sparse, prescale_factor=prescale_factor,
                     postscale_factor=postscale_factor, process_set=process_set)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, name=None, process_set=global_process_set):
    """``allreduce`` of a list; the ops run concurrently inside a tf.function."""
    process_sets.resolve(process_set, "grouped_allreduce")
    names = [None] * len(tensors) if name is None else \
        [f"{name}/{i}" for i in range(len(tensors))]
    return [allreduce(t, average=average, device_dense=device_dense,
                      device_sparse=device_sparse, compression=compression,
                      op=op, prescale_factor=prescale_factor,
                      postscale_factor=postscale_factor, name=n, process_set=process_set)
            for t, n in zip(tensors, names)]


# --------------------------------------------------------------------------
# allgather
# --------------------------------------------------------------------------
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
    tensor = collectives.scale_gradient(tensor, 1.0 / ps.size())
    with collectives.agreement_scope(set=process_sets.set_agreement(ps), op=""):
        gathered, _ = collectives.allgather(tensor, key, ps.rank(), ps.size(), widen=True)
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
    tensor = collectives.scale_gradient(tensor, 1.0 / ps.size())
    with collectives.agreement_scope(set=process_sets.set_agreement(ps), op=""):
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
        with collectives.agreement_scope(set=process_sets.set_agreement(ps), op=""):
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


# --------------------------------------------------------------------------
# Gradients: shared by DistributedGradientTape and the Keras optimizer
# --------------------------------------------------------------------------
def predivide_scales(op, gradient_predivide_factor, where: str):
    """Horovod's ``gradient_predivide_factor``: (prescale, postscale) that
    split the average into a division by the factor before the sum and the
    rest after it, so large sums stay in range. Only for ``op=Average``."""
    factor = float(gradient_predivide_factor)
    if factor == 1.0:
        return 1.0, 1.0
    if factor <= 0.0:
        raise ValueError(f"{where}: gradient_predivide_factor must be > 0, got {factor}.")
    if op != Average:
        raise ValueError(f"{where}: gradient_predivide_factor needs op=Average, got "
                         f"op={ReduceOp(op).name.title()}.")
    # Average divides the sum by size(): x/f summed, /size, *f == sum/size.
    return 1.0 / factor, factor


def reduce_gradients(grads, sources, prefix, compression=Compression.none,
                     sparse_as_dense=False, op=Average, priority_fn=None,
                     postscale_factor=1.0, prescale_factor=1.0,
                     process_set=global_process_set):
    """Push-pulls a list of gradients named after their ``sources``.

    Priority is ``-index`` by default: earlier sources are needed earlier
    in the next forward pass; inside a graph the C++ priority pass replaces
    it with the order the graph reads the variables in. ``priority_fn(index,
    source)`` chooses instead, and the pass keeps its choice.
    ``None`` gradients pass through, and so does every gradient of a worker
    outside ``process_set`` or alone in it (Horovod's rule).
    """
    async_training.refuse_gradient_exchange(prefix)
    if not process_sets.reduces_over(process_sets.resolve(process_set, prefix,
                                                          members_only=False)):
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
            out.append(push_pull(grad, name=name, compression=compression, op=op,
                                 priority=priority, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, process_set=process_set))
    if process_sets.resolve(process_set, prefix, members_only=False).ranks is not None:
        return out     # a process set's members only: the fingerprint table spans all
    # Every N steps: the variables must still be the same on every worker.
    trained = [s for s, g in zip(sources, grads) if g is not None and hasattr(s, "assign")]
    return fingerprint.checked(out, trained, prefix, f"{prefix} gradients")
