"""The Horovod/BytePS-style TensorFlow API, built on the two ops of ``bps_tf.ops``.

Everything here reduces to ``push_pull_sum`` (a cross-worker sum) and
``broadcast_raw``:

* ``push_pull`` / ``allreduce``: sum, then average (``op=Average``, the default).
* ``allgather``: every worker writes its rows at its offset in a zero buffer
  of the total size; the sum of those buffers is the concatenation.
* ``broadcast`` / ``broadcast_variables`` / ``broadcast_object``.
* ``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient`` returns
  averaged gradients.

Names. Workers match tensors by name, so every worker must give the same
tensor the same name:

* an explicit ``name=`` always wins;
* inside a ``tf.function`` the name comes from the tensor's op name, which is
  the same on every worker that traces the same program;
* in eager mode without a name, a per-process counter numbers the calls, so
  unnamed eager calls must happen **in the same order on every worker** (give
  names to calls made in a loop: each unnamed call is a new key).

The name given to the op carries a family prefix (``PushPull/``,
``Broadcast/``, ``Allgather/`` ...) so that, say, a broadcast and a push_pull
named ``w`` never meet on one key. Within one traced graph a name used twice
gets ``_1``, ``_2`` ... appended, in tracing order (the same on every worker).

Averages. Floating tensors are divided by ``size()``. Integer tensors are
floor-divided (``tf.math.floordiv``), which keeps their dtype: the average of
3 and 4 over 2 workers is 3, of -3 and -4 is -4.
"""
from __future__ import annotations

import contextlib
import enum
import itertools
import pickle
import threading
import weakref
from typing import Any, List, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.ops import control_flow_util

from bps_tf import basics
from bps_tf.rewriter import unique_name

__all__ = [
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "Compression", "Compressor", "NoneCompressor", "FP16Compressor",
    "push_pull", "allreduce", "grouped_allreduce", "allgather", "broadcast",
    "broadcast_variables", "broadcast_object", "DistributedGradientTape",
    "reduce_gradients", "variable_name", "SUPPORTED_DTYPES",
]


# --------------------------------------------------------------------------
# Reduce ops and compression
# --------------------------------------------------------------------------
class ReduceOp(enum.IntEnum):
    AVERAGE = 0
    SUM = 1
    # Horovod names that have no parameter-server equivalent. They exist so
    # that code written for Horovod imports, and fails clearly where used.
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

SUPPORTED_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64)


class Compressor:
    """Turns a tensor into what travels, and back. ``ctx`` carries what
    ``decompress`` needs (here: the original dtype)."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """float32/float64 travel as float16 (half the bytes); other dtypes are
    left alone."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype in (tf.float32, tf.float64):
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor


# --------------------------------------------------------------------------
# Helpers: initialization check, op access, names
# --------------------------------------------------------------------------
def _require_init() -> None:
    if not basics.is_initialized():
        raise basics.NotInitializedError(
            "bps_tf is not initialized: call bps_tf.init() first (once per "
            "process, before any push_pull, broadcast or allgather).")
    if not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(
            tf.compat.v1.get_default_graph()):
        # XLA would fail later with a long list of "unsupported operations".
        raise RuntimeError(
            "bps_tf collectives cannot run inside XLA-compiled code "
            "(jit_compile=True). For Keras, compile the model with "
            "jit_compile=False (Keras' 'auto' turns XLA on when a GPU is present).")


def _ops():
    # Imported on first use so that importing this module never loads the
    # op library (and so that `import bps_tf.keras` stays cheap).
    from bps_tf import ops
    return ops


_eager_counter = itertools.count()
_eager_lock = threading.Lock()
# Names already handed out in each traced graph, to make repeats unique.
_graph_names: "weakref.WeakKeyDictionary[Any, set]" = weakref.WeakKeyDictionary()


def _next_eager_index() -> int:
    with _eager_lock:
        return next(_eager_counter)


def _unique_in_graph(name: str) -> str:
    graph = tf.compat.v1.get_default_graph()
    return unique_name(name, _graph_names.setdefault(graph, set()))


def _tensor_op_name(tensor) -> Optional[str]:
    if isinstance(tensor, tf.IndexedSlices):
        tensor = tensor.values
    try:
        return tensor.op.name
    except AttributeError:   # eager tensors have no op
        return None


def _op_name(family: str, name: Optional[str], tensor=None) -> str:
    """The name given to the op: family prefix + explicit or derived name."""
    if tf.executing_eagerly():
        if name is None:
            name = f"eager.{_next_eager_index()}"
        return f"{family}/{name}"
    if name is None:
        name = _tensor_op_name(tensor) or "tensor"
    return _unique_in_graph(f"{family}/{name}")


def variable_name(variable) -> str:
    """A variable's stable name: Keras 3 ``.path``, else ``.name`` without ':0'."""
    path = getattr(variable, "path", None)
    if isinstance(path, str) and path:
        return path
    name = getattr(variable, "name", None) or "variable"
    return name[:-2] if name.endswith(":0") else name


def _unique_names(names: Sequence[str]) -> List[str]:
    """Makes a list of names unique (two unnamed tf.Variables are both
    'Variable'); suffixes depend only on list order, so workers agree."""
    seen, out = {}, []
    for name in names:
        n = seen.get(name, 0)
        seen[name] = n + 1
        out.append(name if n == 0 else f"{name}_{n}")
    return out


def _check_dtype(tensor, what: str) -> None:
    if tensor.dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise TypeError(f"{what}: dtype {tensor.dtype.name} is not supported "
                        f"(supported: {supported}).")


def _resolve_op(average, op):
    if average is not None and op is not None:
        raise ValueError("push_pull/allreduce: give either `op` or the deprecated "
                         "`average`, not both.")
    if op is None:
        op = Sum if average is False else Average
    op = ReduceOp(op)
    if op not in (Average, Sum):
        raise NotImplementedError(
            f"reduce op {op.name} is not available in bps_tf (a parameter "
            "server sums); use Average or Sum.")
    return op


def _scale(tensor, factor: float, what: str):
    if factor == 1.0:
        return tensor
    if tensor.dtype.is_integer:
        if float(factor) != int(factor):
            raise ValueError(f"{what}={factor} cannot scale an integer tensor "
                             f"({tensor.dtype.name}); use an integral factor.")
        return tensor * tf.cast(int(factor), tensor.dtype)
    return tensor * tf.cast(factor, tensor.dtype)


def _average(tensor):
    size = basics.size()
    if tensor.dtype.is_integer:
        return tf.math.floordiv(tensor, tf.cast(size, tensor.dtype))
    return tensor / tf.cast(size, tensor.dtype)


# --------------------------------------------------------------------------
# push_pull / allreduce
# --------------------------------------------------------------------------
def push_pull(tensor, average=None, name=None, compression=Compression.none,
              op=None, priority=0, device_dense="", device_sparse="",
              prescale_factor=1.0, postscale_factor=1.0):
    """Reduces ``tensor`` across all workers (``op=Average`` by default).

    ``prescale_factor`` multiplies before the sum, ``postscale_factor`` after
    the average. ``priority``: higher leaves first. An ``IndexedSlices`` is
    gathered (its values and indices concatenated over workers, values divided
    by ``size()`` for Average), as Horovod does.
    """
    _require_init()
    op = _resolve_op(average, op)
    if isinstance(tensor, tf.IndexedSlices):
        with tf.device(device_sparse):
            return _push_pull_sparse(tensor, name, op, prescale_factor,
                                     postscale_factor)
    tensor = tf.convert_to_tensor(tensor)
    _check_dtype(tensor, "push_pull")
    op_name = _op_name("PushPull", name, tensor)
    with tf.device(device_dense):
        sent = _scale(tensor, prescale_factor, "prescale_factor")
        sent, ctx = compression.compress(sent)
        summed = _ops().push_pull_sum(sent, tensor_name=op_name, priority=int(priority))
        result = compression.decompress(summed, ctx)
        if op == Average:
            result = _average(result)
        return _scale(result, postscale_factor, "postscale_factor")


def _push_pull_sparse(slices, name, op, prescale_factor, postscale_factor):
    base = name if name is not None else _tensor_op_name(slices)
    if base is None:   # eager, unnamed: one counter value for both parts
        base = f"eager.{_next_eager_index()}"
    values = _scale(slices.values, prescale_factor, "prescale_factor")
    values = allgather(values, name=f"{base}/values")
    indices = allgather(slices.indices, name=f"{base}/indices")
    if op == Average:
        values = _average(values)
    values = _scale(values, postscale_factor, "postscale_factor")
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, name=None, ignore_name_scope=False,
              priority=0):
    """``push_pull`` under Horovod's name and argument order.
    ``ignore_name_scope`` is accepted for compatibility and has no effect."""
    del ignore_name_scope
    return push_pull(tensor, average=average, name=name, compression=compression,
                     op=op, priority=priority, device_dense=device_dense,
                     device_sparse=device_sparse, prescale_factor=prescale_factor,
                     postscale_factor=postscale_factor)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, name=None):
    """``allreduce`` of a list; the ops run concurrently inside a tf.function."""
    names = [None] * len(tensors) if name is None else \
        [f"{name}/{i}" for i in range(len(tensors))]
    return [allreduce(t, average=average, device_dense=device_dense,
                      device_sparse=device_sparse, compression=compression,
                      op=op, prescale_factor=prescale_factor,
                      postscale_factor=postscale_factor, name=n)
            for t, n in zip(tensors, names)]


# --------------------------------------------------------------------------
# allgather
# --------------------------------------------------------------------------
def allgather(tensor, name=None):
    """Concatenates ``tensor`` over workers along the first dimension, in
    rank order. The first dimension may differ between workers; the others
    must agree.

    Built on the sum: the per-rank row counts are summed first, then each
    worker places its rows at its offset in a zero buffer of the total size
    and the buffers are summed. Exact for every dtype (x + 0 == x), except
    that a float -0.0 comes back as +0.0.
    """
    _require_init()
    tensor = tf.convert_to_tensor(tensor)
    _check_dtype(tensor, "allgather")
    if tensor.shape.rank == 0:
        raise ValueError("allgather needs a tensor with at least one dimension.")
    base = _op_name("Allgather", name, tensor)
    ops, size, rank = _ops(), basics.size(), basics.rank()

    rows = tf.shape(tensor, out_type=tf.int64)[0]
    my_count = tf.scatter_nd([[rank]], tf.reshape(rows, [1]), [size])
    counts = ops.push_pull_sum(my_count, tensor_name=f"{base}/counts")
    total = tf.reduce_sum(counts)
    offset = tf.reduce_sum(counts[:rank])

    # The total may change from call to call under one name: the engine
    # matches tensors by name and shape, so that is a new tensor, not an error.
    data_name = f"{base}/data"
    padding = [[offset, total - offset - rows]] + [[0, 0]] * (tensor.shape.rank - 1)
    placed = tf.pad(tensor, tf.cast(padding, tf.int64))
    return ops.push_pull_sum(placed, tensor_name=data_name)


# --------------------------------------------------------------------------
# broadcast
# --------------------------------------------------------------------------
# dtypes the ops lack, carried exactly as a supported one.
_WIDEN = {tf.bool: tf.int32, tf.int8: tf.int32, tf.uint8: tf.int32,
          tf.int16: tf.int32, tf.uint16: tf.int32, tf.uint32: tf.int64}


def _broadcast_tensor(tensor, op_name: str, root_rank: int, priority: int = 0):
    ops = _ops()
    dtype = tensor.dtype
    if dtype in _WIDEN:
        wide = ops.broadcast_raw(tf.cast(tensor, _WIDEN[dtype]), tensor_name=op_name,
                                 root_rank=root_rank, priority=priority)
        return tf.cast(wide, dtype)
    if dtype == tf.uint64:
        wide = ops.broadcast_raw(tf.bitcast(tensor, tf.int64), tensor_name=op_name,
                                 root_rank=root_rank, priority=priority)
        return tf.bitcast(wide, tf.uint64)
    _check_dtype(tensor, "broadcast")
    return ops.broadcast_raw(tensor, tensor_name=op_name, root_rank=root_rank,
                             priority=priority)


def _check_root(root_rank: int) -> int:
    root_rank = int(root_rank)
    if not 0 <= root_rank < basics.size():
        raise ValueError(f"root_rank {root_rank} is not a rank of this job "
                         f"(size {basics.size()}).")
    return root_rank


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False):
    """Every worker gets ``root_rank``'s value of ``tensor``."""
    del ignore_name_scope
    _require_init()
    root_rank = _check_root(root_rank)
    tensor = tf.convert_to_tensor(tensor)
    return _broadcast_tensor(tensor, _op_name("Broadcast", name, tensor), root_rank)


def broadcast_variables(variables, root_rank=0):
    """Assigns ``root_rank``'s values to ``variables`` in place, on every worker.

    All broadcasts run inside one ``tf.function`` so they overlap (100
    variables cost about one round trip, not 100). Names come from each
    variable's Keras 3 ``.path`` (or ``.name``), so workers must build the
    same variables under the same names.
    """
    _require_init()
    root_rank = _check_root(root_rank)
    variables = list(variables)
    if not variables:
        return
    names = _unique_names(["BroadcastVariables/" + variable_name(v) for v in variables])

    def assign_all():
        for priority, (var, name) in enumerate(zip(variables, names)):
            value = _broadcast_tensor(tf.convert_to_tensor(var), name, root_rank,
                                      priority=-priority)
            var.assign(value)

    if tf.executing_eagerly():
        tf.function(assign_all, autograph=False)()
    else:
        assign_all()


def broadcast_object(obj, root_rank=0, name=None):
    """Returns ``root_rank``'s ``obj`` on every worker (any picklable object).

    Eager only. The pickled bytes travel as int32 words; their length is
    broadcast first so the other workers can size the buffer.
    """
    _require_init()
    if not tf.executing_eagerly():
        raise RuntimeError("broadcast_object works in eager mode only.")
    root_rank = _check_root(root_rank)
    base = _op_name("BroadcastObject", name)
    is_root = basics.rank() == root_rank
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if is_root else b""
    length = _broadcast_tensor(tf.constant([len(payload)], tf.int64),
                               f"{base}/length", root_rank)
    nbytes = int(length.numpy()[0])
    words = (nbytes + 3) // 4
    if is_root:
        padded = payload + b"\0" * (words * 4 - nbytes)
        buf = np.frombuffer(padded, dtype=np.int32).copy()
    else:
        buf = np.zeros([words], np.int32)
    data = _broadcast_tensor(tf.constant(buf), f"{base}/data", root_rank)
    return pickle.loads(data.numpy().tobytes()[:nbytes])


# --------------------------------------------------------------------------
# Gradients: shared by DistributedGradientTape and the Keras optimizer
# --------------------------------------------------------------------------
def reduce_gradients(grads, sources, prefix, compression=Compression.none,
                     sparse_as_dense=False, op=Average, priority_fn=None,
                     postscale_factor=1.0):
    """Push-pulls a list of gradients named after their ``sources``.

    Priority is ``-index`` by default: earlier sources are needed earlier
    in the next forward pass; inside a graph the C++ priority pass replaces
    it with the order the graph reads the variables in. ``priority_fn(index,
    source)`` chooses instead, and the pass keeps its choice.
    ``None`` gradients pass through.
    """
    names = _unique_names([f"{prefix}/{_source_name(s, i)}" for i, s in enumerate(sources)])
    out = []
    for index, (grad, source, name) in enumerate(zip(grads, sources, names)):
        if grad is None:
            out.append(None)
            continue
        if sparse_as_dense and isinstance(grad, tf.IndexedSlices):
            grad = tf.convert_to_tensor(grad)
        priority = -index if priority_fn is None else int(priority_fn(index, source))
        with _keep_priority(priority_fn is not None):
            out.append(push_pull(grad, name=name, compression=compression, op=op,
                                 priority=priority, postscale_factor=postscale_factor))
    return out


def _keep_priority(keep: bool):
    """Marks the push_pulls built inside (node attr ``_bps_keep_priority``)
    so the priority pass (bps_tf/ops/priority_pass.cc) leaves their priority
    as given. Set at creation: nothing changes op attributes afterwards."""
    if not keep or tf.executing_eagerly():
        return contextlib.nullcontext()
    graph = tf.compat.v1.get_default_graph()
    return graph._attr_scope(  # pylint: disable=protected-access
        {"_bps_keep_priority": attr_value_pb2.AttrValue(b=True)})


def _source_name(source, index: int) -> str:
    if isinstance(source, (tf.Variable,)) or hasattr(source, "path"):
        return variable_name(source)
    return _tensor_op_name(source) or f"source{index}"


def __getattr__(name):
    # The tape lives in bps_tf/tape.py (which imports this module); keep the
    # Horovod-style spelling `api.DistributedGradientTape` working.
    if name == "DistributedGradientTape":
        from bps_tf.tape import DistributedGradientTape
        return DistributedGradientTape
    raise AttributeError(f"module 'bps_tf.api' has no attribute {name!r}")
