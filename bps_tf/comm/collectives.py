"""Collectives on top of the two ops: the only module that calls ``bps_tf.ops``.

Both faces (the Horovod-style ``api``/``tape``/``keras`` and the
``BytePSStrategy`` ``cross_device_ops``) reduce, broadcast and gather
through these functions; the keys they pass are formed by ``bps_tf.comm.naming``.

* :func:`push_pull_sum` -- the cross-worker sum, optionally carrying dtypes
  the op lacks in a wider one (:data:`WIDEN`, exact);
* :func:`broadcast` -- the root's value; every dtype is carried exactly
  (narrow integers and bool widened, uint64 bit-cast);
* :func:`allgather` -- rows of every worker in rank order, built on the sum:
  the per-rank row counts are summed first, then each worker places its
  rows at its offset in a zero buffer of the total size and the buffers are
  summed. Exact for every dtype (x + 0 == x), except that a float -0.0
  comes back as +0.0;
* :func:`reduce_on_servers` -- min, max and product, computed by the
  servers in the tensor's dtype;
* :func:`divide` -- averages: floating tensors are divided, integer tensors
  floor-divided (``tf.math.floordiv``, keeping the dtype: the average of 3
  and 4 over 2 workers is 3, of -3 and -4 is -4); :func:`scale` for
  pre/postscale factors.

The op library is loaded on first use, so importing this module (and
``bps_tf.keras``) stays cheap.
"""
from __future__ import annotations

import contextlib
import threading

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.ops import control_flow_util

from bps_tf.comm import naming
from bps_tf.runtime import basics

# dtypes the ops support directly
SUPPORTED_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64)
# dtypes the ops lack, carried exactly as a supported one
WIDEN = {tf.bool: tf.int32, tf.int8: tf.int32, tf.uint8: tf.int32, tf.int16: tf.int32,
         tf.uint16: tf.int32, tf.uint32: tf.int64}
# The Horovod face: what allreduce (every reduce op), reducescatter and
# alltoall take, and what allgather and broadcast take besides (bool). The
# narrow integers travel as int32; a sum comes back wrapped as their own
# type would wrap it (the int32 sum of a few workers never overflows).
REDUCE_DTYPES = (tf.uint8, tf.int8, tf.uint16, tf.int16) + SUPPORTED_DTYPES
GATHER_DTYPES = REDUCE_DTYPES + (tf.bool,)
# Reductions the servers compute besides the sum (the op's reduce_op attr).
SERVER_REDUCTIONS = ("min", "max", "product")
# Reductions that are not a variable's gradient (SyncBatchNorm statistics,
# end-of-data agreement, metrics) block the step that issues them: send
# them before any gradient (gradients get 0, -1, -2, ... from their order).
BLOCKING_PRIORITY = 1
# Updates of non-trainable state (BatchNormalization's moving statistics):
# nothing in the step waits for them, so they go after every gradient.
STATE_PRIORITY = -(1 << 20)


# What the ops created now must agree on across workers (see agreement_scope).
_agreement = threading.local()


@contextlib.contextmanager
def agreement_scope(**terms):
    """Every push_pull and broadcast created inside carries ``terms`` in its
    ``agreement`` attr (``op=average``, ``set=0,2`` ...): workers that pass
    different values under one name all fail at once, naming both. A
    ``set`` term makes the op a process-set collective: only those ranks
    take part (the core waits for them alone). Inner scopes override
    outer ones term by term; a term given as "" is dropped."""
    previous = getattr(_agreement, "terms", {})
    merged = dict(previous)
    merged.update(terms)
    _agreement.terms = {k: v for k, v in merged.items() if v}
    try:
        yield
    finally:
        _agreement.terms = previous


@contextlib.contextmanager
def membership_free():
    """Ops created inside read the membership when they run (their averages
    and rank-dependent rows come from :mod:`bps_tf.comm.membership`), so a
    graph traced in one membership stays right in the next: they carry no
    membership epoch. A process set's ops keep it: their ranks are fixed."""
    previous = getattr(_agreement, "free", False)
    _agreement.free = True
    try:
        yield
    finally:
        _agreement.free = previous


def current_agreement() -> str:
    """The agreement text of the innermost :func:`agreement_scope` ("" if none)."""
    terms = getattr(_agreement, "terms", {})
    view = basics.membership_epoch()
    if view is not None and ("set" in terms or not getattr(_agreement, "free", False)):
        # Elastic: the membership epoch the op is built in; the core refuses
        # to run it in another (sizes and ranks traced into it would be stale).
        terms = dict(terms, view=view)
    return " ".join(f"{k}={terms[k]}" for k in sorted(terms))


def _agreement_kwargs() -> dict:
    # Ops outside any scope keep their default attr (graphs stay as before).
    agreement = current_agreement()
    return {"agreement": agreement} if agreement else {}


def _ops():
    # Imported on first use so that importing this module never loads the
    # op library.
    from bps_tf import ops
    from bps_tf.comm import gradients  # noqa: F401  (registers the ops' gradients)
    return ops


def membership_op(query: str):
    """An int32 scalar op that reads this worker's ``query`` ('rank',
    'size', ...) when the graph runs (see bps_tf.comm.membership)."""
    return _ops().membership(query)


def load_op_library() -> None:
    """Loads the op library now (it fails early with the build command)."""
    _ops()


def require_init() -> None:
    """Raises unless bps_tf is initialized and the caller is outside XLA."""
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


def _supported_list() -> str:
    return ", ".join(d.name for d in SUPPORTED_DTYPES)


def check_dtype(tensor, what: str, allowed=SUPPORTED_DTYPES) -> None:
    """Raises a TypeError naming ``what`` unless ``tensor``'s dtype is one of
    ``allowed`` (by default: what the ops carry directly)."""
    if tensor.dtype not in allowed:
        names = ", ".join(d.name for d in allowed)
        raise TypeError(f"{what}: dtype {tensor.dtype.name} is not supported "
                        f"(supported: {names}).")


def row_tensor(tensor, what: str, dtypes):
    """``tensor`` as a tensor for a collective over rows (allgather, alltoall):
    a dtype in ``dtypes`` and at least one dimension, else a clear error."""
    tensor = tf.convert_to_tensor(tensor)
    check_dtype(tensor, what, dtypes)
    if tensor.shape.rank == 0:
        raise ValueError(f"{what} needs a tensor with at least one dimension.")
    return tensor


def check_root(root_rank: int) -> int:
    root_rank = int(root_rank)
    if not 0 <= root_rank < basics.size():
        raise ValueError(f"root_rank {root_rank} is not a rank of this job "
                         f"(size {basics.size()}).")
    return root_rank


def scale(tensor, factor: float, what: str):
    """``tensor * factor`` computed as Horovod does on the CPU: integers in
    float64 (the product truncated back to the dtype), float16/bfloat16 in
    float32, other floats in their own dtype. ``what`` names the argument."""
    del what
    if factor == 1.0:
        return tensor
    dtype = tensor.dtype
    if dtype.is_integer or dtype in (tf.float16, tf.bfloat16):
        wide = tf.float64 if dtype.is_integer else tf.float32
        return tf.cast(tf.cast(tensor, wide) * tf.constant(factor, wide), dtype)
    return tensor * tf.cast(factor, dtype)


def scale_gradient(tensor, factor):
    """``tensor`` unchanged, its gradient multiplied by ``factor``: gives a
    collective built on the sum Horovod's gradient (an allgather's and a
    broadcast's gradient are averaged over the workers, a reducescatter's
    summed). Integer and bool tensors, which carry no gradient, pass as is.
    ``factor`` is a number, or a callable that makes it when the gradient
    is built (a size read at run time, see bps_tf.comm.membership)."""
    if not tensor.dtype.is_floating or (not callable(factor) and factor == 1.0):
        return tensor

    @tf.custom_gradient
    def scaled(x):
        def grad(dy):
            f = factor() if callable(factor) else factor
            return dy * tf.cast(f, dy.dtype)
        return tf.identity(x), grad

    return scaled(tensor)


def divide(tensor, n):
    """The average of a sum over ``n`` contributions (floor division for
    ints); ``n`` a number or a scalar tensor (a size read at run time)."""
    if tensor.dtype.is_integer:
        return tf.math.floordiv(tensor, tf.cast(n, tensor.dtype))
    return tensor / tf.cast(n, tensor.dtype)


def push_pull_sum(tensor, key: str, priority: int = 0, widen: bool = False,
                  compression: str = ""):
    """Sum of ``tensor`` over all workers under ``key``.

    With ``widen``, dtypes in :data:`WIDEN` travel in the wider dtype and
    come back in their own; any other unsupported dtype is a TypeError
    naming the key (without ``widen`` the caller checks the dtype).
    ``compression``: the core's compressor text (``bps_tf.comm.compression.core_spec``),
    applied by the engine to float32 tensors of at least BYTEPS_MIN_COMPRESS_BYTES.
    """
    dtype = tensor.dtype
    extra = _agreement_kwargs()
    if widen and dtype in WIDEN:
        summed = _ops().push_pull_sum(tf.cast(tensor, WIDEN[dtype]), tensor_name=key,
                                      priority=int(priority), **extra)
        return tf.cast(summed, dtype)
    if widen and dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"BytePSStrategy cannot reduce a {dtype.name} tensor across workers "
                        f"({key}); supported: {_supported_list()}.")
    if compression:
        extra["compression"] = compression
    return _ops().push_pull_sum(tensor, tensor_name=key, priority=int(priority), **extra)


def keep_priority(keep: bool):
    """A context in which the push_pulls created are marked (node attr
    ``_bps_keep_priority``) so the C++ priority pass (ops/priority_pass.cc)
    leaves their priority as given, e.g. a user's ``priority_fn`` choice. Set
    at creation: nothing changes op attributes afterwards."""
    if not keep or tf.executing_eagerly():
        return contextlib.nullcontext()
    graph = tf.compat.v1.get_default_graph()
    return graph._attr_scope(  # pylint: disable=protected-access
        {"_bps_keep_priority": attr_value_pb2.AttrValue(b=True)})


def refuse_when_joined(key: str) -> None:
    """Operations under ``key`` fail instead of completing while a worker has
    joined (Horovod refuses allgathers then; a broadcast is refused by the
    engine itself)."""
    if basics.is_initialized():
        basics.core().refuse_when_joined(key)


def label_tensor(key: str, label: str) -> None:
    """Shows ``label`` (e.g. the variable's path) beside ``key`` in the core's
    error messages and timeline; keys alone match tensors across workers."""
    if basics.is_initialized():
        basics.core().set_tensor_label(key, label)


def decided_priorities() -> dict:
    """tensor_name -> the priority the C++ priority pass gave that push_pull
    in this process (what its kernel receives)."""
    from bps_tf.ops import pass_record
    return pass_record.priorities()


def configure_graph_rewrite(on: bool, num_workers: int = 1, rank: int = 0,
                            average: bool = True) -> None:
    """Switches the TF1 graph rewrite of the priority pass (ops/graph_rewrite.cc)."""
    from bps_tf.ops import pass_record
    pass_record.configure_graph_rewrite(on, num_workers, rank, average)


def collective_ops(graph) -> list:
    """The push_pull-family ops created so far in ``graph`` (in creation
    order): what an op that must run after them depends on."""
    types = set(_ops().OP_TYPES)
    return [op for op in graph.get_operations() if op.type in types]


def push_pull_op(result):
    """The push_pull op behind a :func:`push_pull_sum` result (None in eager
    mode), looking through the cast back from a widened dtype."""
    if tf.executing_eagerly():
        return None
    op = result.op
    return op.inputs[0].op if op.type == "Cast" else op


def broadcast(tensor, key: str, root_rank: int, priority: int = 0):
    """``root_rank``'s value of ``tensor`` under ``key``, exact for every dtype."""
    ops = _ops()
    dtype = tensor.dtype
    extra = _agreement_kwargs()
    if dtype in WIDEN:
        wide = ops.broadcast_raw(tf.cast(tensor, WIDEN[dtype]), tensor_name=key,
                                 root_rank=root_rank, priority=priority, **extra)
        return tf.cast(wide, dtype)
    if dtype == tf.uint64:
        wide = ops.broadcast_raw(tf.bitcast(tensor, tf.int64), tensor_name=key,
                                 root_rank=root_rank, priority=priority, **extra)
        return tf.bitcast(wide, tf.uint64)
    check_dtype(tensor, "broadcast")
    return ops.broadcast_raw(tensor, tensor_name=key, root_rank=root_rank, priority=priority,
                             **extra)


def allgather(tensor, key: str, rank: int, size: int, priority: int = 0,
              widen: bool = False, key_per_size: bool = False):
    """Rows of ``tensor`` from all workers, in rank order; returns
    ``(rows, [push_pull ops])`` (no ops in eager mode).

    The first dimension may differ between workers; the others must agree.
    The total may change from call to call under one key: the engine matches
    tensors by name and shape, so that is a new tensor, not an error.
    ``key_per_size`` adds the total to the eager data key (for callers whose
    eager keys repeat).
    """
    rows = tf.shape(tensor, out_type=tf.int64)[0]
    slots = tf.scatter_nd([[rank]], tf.reshape(rows, [1]), [size])
    counts_key = naming.part_key(key, "counts")
    refuse_when_joined(counts_key)
    counts = push_pull_sum(slots, counts_key, priority, widen)
    total = tf.reduce_sum(counts)
    offset = tf.reduce_sum(counts[:rank])
    pad = tf.stack([tf.stack([offset, total - offset - rows])] +
                   [tf.zeros([2], tf.int64)] * (tensor.shape.rank - 1))
    eager_total = int(total) if key_per_size and tf.executing_eagerly() else None
    data_key = naming.allgather_data_key(key, eager_total)
    refuse_when_joined(data_key)
    gathered = push_pull_sum(tf.pad(tensor, pad), data_key, priority, widen)
    found = [push_pull_op(counts), push_pull_op(gathered)]
    return gathered, [op for op in found if op is not None]


def reduce_on_servers(tensor, key: str, kind: str, priority: int = 0):
    """Min, max or product (``kind``, one of :data:`SERVER_REDUCTIONS`) of
    ``tensor`` over all workers (of the process set of the current
    :func:`agreement_scope`), computed by the servers in the dtype the
    tensor travels in: exact for every dtype of :data:`REDUCE_DTYPES`. The
    narrow integers travel as int32, where min and max are exact and a
    product's low bits -- all that their own type keeps -- are too (integer
    products wrap as the type does). Runs on the CPU kernel (the GPU kernel
    only sums)."""
    if kind not in SERVER_REDUCTIONS:
        raise ValueError(f"reduce '{key}': unknown reduction {kind!r} "
                         f"(one of {', '.join(SERVER_REDUCTIONS)}).")
    check_dtype(tensor, f"reduce ({kind}) '{key}'", REDUCE_DTYPES)
    dtype = tensor.dtype
    wide = WIDEN.get(dtype)
    with tf.device("/device:CPU:0"):
        sent = tf.cast(tensor, wide) if wide is not None else tensor
        out = _ops().push_pull_reduce(sent, tensor_name=key, reduce_op=kind,
                                      priority=int(priority), **_agreement_kwargs())
        return tf.cast(out, dtype) if wide is not None else out


def kernel_devices(op_type: str = "BytepsPushPull") -> set:
    """Device types with a kernel registered for ``op_type`` in the loaded
    op library (``{"CPU"}``, or ``{"CPU", "GPU"}`` for a CUDA build)."""
    from tensorflow.python.framework import kernels
    _ops()
    return {k.device_type for k in kernels.get_registered_kernels_for_op(op_type).kernel}


# Scaled float16 transport. The scale is a power of two (so scaling itself
# is exact) chosen from the sum over workers of each worker's largest |x|,
# which bounds every partial sum a server forms: nothing overflows to inf
# unless the input held an inf. Small gradients are scaled up, out of
# float16's subnormal range.
FP16_TARGET = 2.0 ** 15      # half of float16's largest finite value (65504)
FP16_MAX_UPSCALE = 2.0 ** 24


def fp16_scale(bound):
    """The power-of-two factor (float64) for values whose summed magnitudes are ``bound``."""
    safe = tf.math.is_finite(bound) & (bound > 0)
    ratio = FP16_TARGET / tf.where(safe, bound, tf.constant(1.0, tf.float64))
    exponent = tf.floor(tf.math.log(ratio) / tf.math.log(tf.constant(2.0, tf.float64)))
    scale = tf.minimum(tf.pow(tf.constant(2.0, tf.float64), exponent), FP16_MAX_UPSCALE)
    # A non-finite input stays non-finite (inf * 0 would make it nan).
    return tf.where(safe, scale, tf.constant(1.0, tf.float64))


def push_pull_sum_fp16(tensor, key: str, priority: int = 0, with_op: bool = False):
    """Sum of a float32/float64 ``tensor`` that travels as float16, scaled so
    that no sum overflows. Costs one extra 8-byte push_pull under
    ``<key>/range`` (both run concurrently with other tensors in a tf.function)."""
    magnitudes = tf.abs(tf.cast(tf.reshape(tensor, [-1]), tf.float64))
    peak = tf.reduce_max(tf.concat([magnitudes, tf.zeros([1], tf.float64)], 0))
    bound = push_pull_sum(tf.reshape(peak, [1]), naming.part_key(key, "range"), priority)[0]
    scale = fp16_scale(bound)
    half = tf.cast(tensor * tf.cast(scale, tensor.dtype), tf.float16)
    summed = push_pull_sum(half, key, priority)
    result = tf.cast(summed, tensor.dtype) / tf.cast(scale, tensor.dtype)
    return (result, push_pull_op(summed)) if with_op else result


# Split push_pull (cross-step overlap, bps_tf/overlap/loop.py): the sum is started
# now and taken later, possibly in the next tf.function call. The result
# waits in a per-process table under its key.
def push_pull_start(tensor, key: str, priority: int = 0):
    """Starts the sum of ``tensor`` over all workers under ``key``; returns an
    int64 token at once. Inside a traced function the op runs independently
    of the other stateful ops (it is neither chained in program order nor
    waited for by them), but always before the function returns. Starting a
    key that is still pending fails at run time, naming the key."""
    check_dtype(tensor, f"push_pull_start '{key}'")
    token = _ops().push_pull_start(tensor, tensor_name=key, priority=int(priority))
    run_independently(token)
    return token


def run_independently(tensor) -> None:
    """Inside a traced function: the op of ``tensor`` is not chained in
    program order with the other stateful ops (nothing waits behind it), but
    still runs before the function returns. Eager: nothing to do."""
    if not tf.executing_eagerly():
        manager = getattr(tf.compat.v1.get_default_graph(), "experimental_acd_manager", None)
        if manager is not None:
            manager.run_independently(tensor.op)


def push_pull_wait(like, key: str):
    """``(sum, valid)`` of the sum started under ``key``: waits for it and takes
    it out of the table. ``valid`` is False (and ``sum`` zeros shaped like
    ``like``) when nothing is pending under ``key``; an engine failure of the
    pending sum is raised by this op."""
    check_dtype(like, f"push_pull_wait '{key}'")
    summed, valid = _ops().push_pull_wait(like, tensor_name=key)
    return summed, valid


def pending_push_pulls() -> list:
    """Keys started by :func:`push_pull_start` and not yet taken (eager only)."""
    return [k.decode() for k in _ops().push_pull_pending_keys().numpy().tolist()]


def drop_pending() -> None:
    """Elastic: takes every sum started by :func:`push_pull_start` out of the
    table after a membership restart (they belonged to the old epoch and
    failed or were dropped with it), so that no later wait receives one."""
    for key in pending_push_pulls():
        try:
            push_pull_wait(tf.zeros([1], tf.int64), key)
        except (tf.errors.OpError, ValueError):
            pass   # the old epoch's failure, or another shape: taken out all the same


def debug_hold_push_pull(key: str, timeout_ms: int = 10000) -> None:
    """Diagnostics for tests: the next push_pull started under ``key`` is
    kept from its wait, once finished, until :func:`debug_marker` runs (or
    ``timeout_ms`` passes); see :func:`debug_hold_log`."""
    _ops().push_pull_debug_hold(tf.zeros([]), "hold", key, timeout_ms)


def debug_marker(x):
    """``x``, passing a marker that ends a :func:`debug_hold_push_pull`."""
    return _ops().push_pull_debug_hold(x, "marker")[0]


def debug_hold_log() -> str:
    """Lines "<key> released-by marker|timeout" or "<key> in-flight-at marker"."""
    return _ops().push_pull_debug_hold(tf.zeros([]), "log")[1].numpy().decode()
