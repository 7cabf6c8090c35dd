"""Horovod's reducescatter, alltoall and grouped allgather, on the servers' sum.

The servers only sum, so these collectives are built from the sum and the
allgather of ``bps_tf.comm.collectives``; results are exact for every dtype they
take (Horovod's: uint8, int8, uint16, int16, int32, int64, float16,
bfloat16, float32, float64; bool too for alltoall), at a cost in traffic:

* ``reducescatter``: every worker receives the whole sum and keeps its rows
  (a push_pull of the full tensor, not 1/size of it);
* ``alltoall``: every worker receives every worker's tensor (an allgather)
  and keeps the rows sent to it, plus one small allgather of the splits.

Keys (``bps_tf.comm.naming``): ``Reducescatter/<name>``, ``Alltoall/<name>/splits``
and ``Alltoall/<name>/data``; grouped calls add ``/<i>`` to an explicit name.
"""
from __future__ import annotations

import tensorflow as tf

from bps_tf.comm import collectives, membership, naming
from bps_tf.comm.collectives import require_init
from bps_tf.comm.compression import Compression
from bps_tf.comm.exchange import allgather, gather_rows
from bps_tf.comm.reduction import Average, ReduceOp, Reduction, Sum
from bps_tf.runtime import process_sets
from bps_tf.runtime.process_sets import global_process_set

__all__ = ["grouped_allgather", "reducescatter", "grouped_reducescatter", "alltoall",
           "alltoall_cpu2gpu", "alltoall_gpu2cpu", "scatter_rows"]


def grouped_names(name, count):
    """Per-tensor names of a grouped call: ``<name>/<i>``, or all None."""
    return [None] * count if name is None else [f"{name}/{i}" for i in range(count)]


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """``allgather`` of each tensor of a list; inside a tf.function the
    gathers run concurrently."""
    process_sets.resolve(process_set, "grouped_allgather")
    return [allgather(t, name=n, process_set=process_set)
            for t, n in zip(tensors, grouped_names(name, len(tensors)))]


# --------------------------------------------------------------------------
# reducescatter
# --------------------------------------------------------------------------
def scatter_rows(rows, rank, size):
    """(first row, row count) of ``rank``'s share of ``rows`` rows split as
    evenly as possible over ``size`` ranks, the lower ranks taking one row
    more when ``rows`` does not divide (Horovod's split). Ints, or tensors
    (a rank and size read when the graph runs)."""
    if all(isinstance(x, int) for x in (rows, rank, size)):
        base, extra = rows // size, rows % size
        return rank * base + min(rank, extra), base + (1 if rank < extra else 0)
    rows = tf.cast(rows, tf.int64)
    rank, size = tf.cast(rank, tf.int64), tf.cast(size, tf.int64)
    base, extra = rows // size, rows % size
    start = rank * base + tf.minimum(rank, extra)
    count = base + tf.cast(rank < extra, tf.int64)
    return start, count


def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average,
                  name=None, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0, process_set=global_process_set):
    """Reduces ``tensor`` over all workers (``op``: Sum or Average), then
    returns this rank's rows of the result: the first dimension is split as
    evenly as possible, lower ranks getting one row more when it does not
    divide. ``prescale_factor`` multiplies before the reduction,
    ``postscale_factor`` after it. Every worker must pass the same shape.
    Every worker receives the whole sum and keeps its rows (the servers only
    sum); rank and size are read when the op runs."""
    ps = process_sets.resolve(process_set, "reducescatter")
    del ignore_name_scope
    require_init()
    op = ReduceOp(op)
    if op not in (Sum, Average):
        raise NotImplementedError(f"reducescatter takes op Sum or Average, not {op.name}.")
    tensor = tf.convert_to_tensor(tensor)
    collectives.check_dtype(tensor, "reducescatter", collectives.REDUCE_DTYPES)
    if tensor.shape.rank == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension.")
    key = naming.op_key("Reducescatter", name, tensor, ps.key_id)
    # Horovod's gradient: the gathered gradients, times size() for a Sum
    # (the sum's own gradient is the gathered ones, the average's 1/size).
    tensor = collectives.scale_gradient(
        tensor, lambda: tf.cast(membership.set_size(ps), tf.float64))
    with tf.device(device_dense):
        reduced = Reduction(key, op, compression=compression, prescale=prescale_factor,
                            process_set=ps).dense(tensor)
        rank, size = membership.in_set(ps)
        rows = tensor.shape[0] if tensor.shape[0] is not None else \
            tf.shape(reduced, out_type=tf.int64)[0]
        start, count = scatter_rows(rows, rank, size)
        mine = reduced[start:start + count]
        return collectives.scale(mine, postscale_factor, "postscale_factor")


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none,
                          op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """``reducescatter`` of each tensor of a list."""
    process_sets.resolve(process_set, "grouped_reducescatter")
    return [reducescatter(t, device_dense=device_dense, compression=compression, op=op,
                          name=n, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, process_set=process_set)
            for t, n in zip(tensors, grouped_names(name, len(tensors)))]


# --------------------------------------------------------------------------
# alltoall
# --------------------------------------------------------------------------
def _checked_splits(tensor, splits, size):
    """``splits`` as an int64 vector of ``size`` counts that add up to the
    first dimension of ``tensor`` (even split when None)."""
    rows = tf.shape(tensor, out_type=tf.int64)[0]
    # Bad splits are InvalidArgumentError, as Horovod's op reports them.
    invalid = tf.errors.InvalidArgumentError
    if splits is None:
        if not isinstance(size, int):   # read when the graph runs
            with tf.control_dependencies([tf.debugging.assert_equal(
                    rows % tf.cast(size, tf.int64), tf.constant(0, tf.int64),
                    message="alltoall without splits needs a first dimension divisible "
                            "by size()")]):
                return tf.fill([size], rows // tf.cast(size, tf.int64))
        if tensor.shape[0] is not None and tensor.shape[0] % size:
            raise invalid(None, None, f"alltoall without splits needs a first dimension "
                                      f"divisible by size() ({size}); got {tensor.shape[0]}.")
        return tf.fill([size], rows // size)
    splits = _checked_counts(splits, size, "splits")
    if tf.executing_eagerly():
        values = splits.numpy().tolist()
        if sum(values) != int(rows):
            raise invalid(None, None, f"alltoall: splits {values} must add up to the first "
                                      f"dimension of the tensor ({int(rows)}).")
        return splits
    with tf.control_dependencies([tf.debugging.assert_equal(
            tf.reduce_sum(splits), rows, message="alltoall: splits must add up to the "
                                                 "first dimension")]):
        return tf.identity(splits)


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set, recv_splits=None, with_size=None,
             compression=None):
    """Sends ``splits[i]`` rows of ``tensor`` (in order) to rank ``i`` and
    returns the rows every rank sent to this one, concatenated in rank order;
    with ``splits`` given, as in Horovod, ``(received, received_splits)``,
    the second saying how many rows came from each rank (int32).
    ``splits=None`` splits the first dimension evenly. A rank may send or
    receive nothing (zeros in the splits, or an empty tensor).

    BytePS's form, chosen by passing ``recv_splits`` or ``with_size``:
    ``recv_splits`` are the rows this rank expects from each rank (checked:
    ``InvalidArgumentError`` if negative or not what the ranks sent), and the
    result is ``received`` alone, or ``(received, received_splits)`` with
    ``with_size=True``. ``compression`` may only be ``Compression.none``."""
    byteps_form = recv_splits is not None or with_size is not None
    if compression is not None and compression is not Compression.none:
        raise ValueError("alltoall: compression is not supported (only Compression.none).")
    if isinstance(tensor, (list, tuple)):
        raise NotImplementedError("alltoall of a list of tensors (BytePS's grouped alltoall) "
                                  "is not available: call alltoall once per tensor.")
    ps = process_sets.resolve(process_set, "alltoall")
    del ignore_name_scope
    require_init()
    tensor = collectives.row_tensor(tensor, "alltoall", collectives.GATHER_DTYPES)
    rank, size = membership.in_set(ps)
    key = naming.op_key("Alltoall", name, tensor, ps.key_id)
    with_splits = splits is not None
    splits = _checked_splits(tensor, splits, size)
    expected = None if recv_splits is None else _checked_counts(recv_splits, size, "recv_splits")
    # matrix[s, d]: rows rank s sends to rank d (ranks within the set)
    matrix, _ = gather_rows(tf.reshape(splits, [1, size]), naming.part_key(key, "splits"),
                            process_set=ps)
    data, _ = gather_rows(tensor, naming.part_key(key, "data"), process_set=ps)
    source_start = tf.cumsum(tf.reduce_sum(matrix, axis=1), exclusive=True)
    received_splits = matrix[:, rank]
    if expected is not None:
        received_splits = _matching(received_splits, expected)
    starts = source_start + tf.reduce_sum(matrix[:, :rank], axis=1)
    index = tf.ragged.range(starts, starts + received_splits).flat_values
    received = tf.gather(data, index)
    sizes = tf.cast(received_splits, tf.int32)
    if byteps_form:
        return (received, sizes) if with_size else received
    return (received, sizes) if with_splits else received


def alltoall_cpu2gpu(tensor, splits=None, recv_splits=None, name=None, with_size=False,
                     compression=None, process_set=global_process_set):
    """BytePS's alltoall whose result lands on this worker's first GPU (on the
    CPU where there is none). The rows travel through host memory in every
    case, so this is :func:`alltoall` (BytePS's form) plus the copy."""
    return _placed(alltoall(tensor, splits, name, process_set=process_set,
                            recv_splits=recv_splits, with_size=bool(with_size),
                            compression=compression), "GPU")


def alltoall_gpu2cpu(tensor, splits=None, recv_splits=None, name=None, with_size=False,
                     compression=None, process_set=global_process_set):
    """BytePS's alltoall whose result lands in host memory, wherever the
    input is: :func:`alltoall` (BytePS's form) plus the copy."""
    return _placed(alltoall(tensor, splits, name, process_set=process_set,
                            recv_splits=recv_splits, with_size=bool(with_size),
                            compression=compression), "CPU")


def _placed(result, kind):
    """``result`` (a tensor, or BytePS's ``(received, sizes)``) with the rows
    copied to the first device of ``kind``; sizes stay in host memory."""
    devices = tf.config.list_logical_devices(kind)
    if not devices:
        return result
    received, *sizes = result if isinstance(result, tuple) else (result,)
    with tf.device(devices[0].name):
        received = tf.identity(received)
    return (received, *sizes) if sizes else received


def _checked_counts(counts, size, what):
    """``counts`` as an int64 vector of ``size`` non-negative numbers."""
    counts = tf.cast(tf.convert_to_tensor(counts), tf.int64)
    invalid = tf.errors.InvalidArgumentError
    if not isinstance(size, int) and counts.shape.rank == 1:   # size read when the graph runs
        with tf.control_dependencies([
                tf.debugging.assert_equal(tf.size(counts, out_type=tf.int32), size,
                                          message=f"alltoall: {what} must have size() counts"),
                tf.debugging.assert_non_negative(counts, message=f"alltoall: negative {what}")]):
            return tf.identity(counts)
    if counts.shape.rank != 1 or (counts.shape[0] is not None and counts.shape[0] != size):
        raise invalid(None, None, f"alltoall: {what} must be a vector of size() = {size} "
                                  f"counts; got shape {counts.shape}.")
    if tf.executing_eagerly():
        if min(counts.numpy().tolist(), default=0) < 0:
            raise invalid(None, None, f"alltoall: {what} {counts.numpy().tolist()} must be "
                                      f"non-negative.")
        return counts
    with tf.control_dependencies([tf.debugging.assert_non_negative(
            counts, message=f"alltoall: negative {what}")]):
        return tf.identity(counts)


def _matching(received_splits, expected):
    """``received_splits``, once checked equal to the caller's recv_splits."""
    if tf.executing_eagerly():
        got, want = received_splits.numpy().tolist(), expected.numpy().tolist()
        if got != want:
            raise tf.errors.InvalidArgumentError(
                None, None, f"alltoall: recv_splits {want} but the ranks sent {got} rows.")
        return received_splits
    with tf.control_dependencies([tf.debugging.assert_equal(
            received_splits, expected, message="alltoall: recv_splits differ from the rows "
                                               "the ranks sent")]):
        return tf.identity(received_splits)
