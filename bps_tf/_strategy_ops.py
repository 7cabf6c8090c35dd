"""PushPullCrossDeviceOps: BytePSStrategy's reductions across devices and workers.

Every reduction the strategy makes (gradients, SyncBatchNorm statistics,
metrics, the end-of-data agreement of distributed iterators, ...) comes here:

1. the local replicas' values are summed on one device first (``add_n``), so
   a worker sends ONE push_pull per tensor, whatever its device count;
2. that sum goes through ``push_pull_sum`` (the cross-worker sum);
3. MEAN divides by the global replica count; the result is copied to each
   destination device (a ``Mirrored`` value).

``IndexedSlices`` (Embedding gradients) are never densified: values and
indices are concatenated over the local replicas, then gathered from all
workers, which is exactly the sum a single process would have computed.

Names. Workers match push_pulls by name, so names must come out the same on
every worker without any agreement step. Inside a traced function a name is
``<graph path>/<n>``: the n-th reduced tensor of that graph, where the graph
path is the function's name and those of enclosing functions, with the
process-wide counter TensorFlow appends to control-flow branch names
stripped. In eager mode it is ``eager/<i>``, the i-th tensor of the call
(eager calls run one after the other, and a name may be reused once the
previous use finished). Nothing depends on layer or variable names, which
Keras numbers per process and which therefore differ between a worker that
built an extra model and one that did not.
"""
from __future__ import annotations

import itertools
import re
import threading
import weakref
from typing import Dict, List

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cdo_lib
from tensorflow.python.distribute import reduce_util
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.framework import indexed_slices

from bps_tf import ops as bps_ops

PREFIX = "bps.strategy"
# Reductions that are not a variable's gradient (SyncBatchNorm statistics,
# end-of-data agreement, metrics) block the step that issues them: send
# them before any gradient (gradients get 0, -1, -2, ... from the C++
# priority pass, bps_tf/ops/priority_pass.cc).
BLOCKING_PRIORITY = 1

# dtypes the op lacks, carried exactly in a wider one
_WIDEN = {tf.bool: tf.int32, tf.int8: tf.int32, tf.uint8: tf.int32, tf.int16: tf.int32,
          tf.uint16: tf.int32, tf.uint32: tf.int64}
_SUPPORTED = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64)
_UID_SUFFIX = re.compile(r"_\d+$")


# --------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------
class _Namer:
    """Stable push_pull names (see the module docstring)."""

    def __init__(self):
        self._counters: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    @staticmethod
    def graph_path(graph) -> str:
        parts = []
        while graph is not None:
            name = getattr(graph, "name", None) or "graph"
            parts.append(_UID_SUFFIX.sub("", str(name)))
            graph = getattr(graph, "outer_graph", None)
        return "/".join(reversed(parts))

    def batch(self, count: int) -> List[str]:
        """Names for the ``count`` tensors of one reduction call."""
        if tf.executing_eagerly():
            return [f"{PREFIX}/eager/{i}" for i in range(count)]
        graph = tf.compat.v1.get_default_graph()
        with self._lock:
            counter = self._counters.get(graph)
            if counter is None:
                counter = self._counters[graph] = itertools.count()
            numbers = [next(counter) for _ in range(count)]
        path = self.graph_path(graph)
        return [f"{PREFIX}/{path}/{n}" for n in numbers]


_init_counter = itertools.count()
_init_lock = threading.Lock()


def next_init_name() -> str:
    """Name for the broadcast of a new variable's initial value: variables
    are created in the same order on every worker (same program)."""
    with _init_lock:
        return f"{PREFIX}/init/{next(_init_counter)}"


# --------------------------------------------------------------------------
# Transport helpers
# --------------------------------------------------------------------------
def _push_pull(tensor, name: str):
    """Cross-worker sum of any numeric tensor; returns (sum, op)."""
    dtype = tensor.dtype
    if dtype in _WIDEN:
        summed = bps_ops.push_pull_sum(tf.cast(tensor, _WIDEN[dtype]), tensor_name=name,
                                       priority=BLOCKING_PRIORITY)
        return tf.cast(summed, dtype), summed.op if not tf.executing_eagerly() else None
    if dtype not in _SUPPORTED:
        raise TypeError(f"BytePSStrategy cannot reduce a {dtype.name} tensor across workers "
                        f"({name}); supported: {', '.join(d.name for d in _SUPPORTED)}.")
    summed = bps_ops.push_pull_sum(tensor, tensor_name=name, priority=BLOCKING_PRIORITY)
    return summed, (summed.op if not tf.executing_eagerly() else None)


def broadcast_from_root(tensor, name: str, root_rank: int = 0):
    """``root_rank``'s value of ``tensor`` (exact for every dtype, -0.0 too)."""
    dtype = tensor.dtype
    if dtype in _WIDEN:
        return tf.cast(bps_ops.broadcast_raw(tf.cast(tensor, _WIDEN[dtype]), tensor_name=name,
                                             root_rank=root_rank), dtype)
    if dtype == tf.uint64:
        return tf.bitcast(bps_ops.broadcast_raw(tf.bitcast(tensor, tf.int64), tensor_name=name,
                                                root_rank=root_rank), tf.uint64)
    return bps_ops.broadcast_raw(tensor, tensor_name=name, root_rank=root_rank)


def allgather_rows(tensor, name: str, rank: int, size: int):
    """Rows of ``tensor`` from all workers, in rank order; returns (rows, ops).

    The row counts are summed first (each worker fills its own slot); then
    each worker places its rows at its offset in a zero buffer of the total
    size, and the sum of the buffers is the concatenation.
    """
    rows = tf.shape(tensor, out_type=tf.int64)[0]
    slots = tf.scatter_nd([[rank]], tf.reshape(rows, [1]), [size])
    counts, counts_op = _push_pull(slots, f"{name}/counts")
    total = tf.reduce_sum(counts)
    offset = tf.reduce_sum(counts[:rank])
    pad = tf.stack([tf.stack([offset, total - offset - rows])] +
                   [tf.zeros([2], tf.int64)] * (tensor.shape.rank - 1))
    data_name = f"{name}/data"
    if tf.executing_eagerly():
        # Eager names are reused from call to call: keep one key per size.
        data_name = f"{data_name}.rows{int(total)}"
    gathered, data_op = _push_pull(tf.pad(tensor, pad), data_name)
    return gathered, [o for o in (counts_op, data_op) if o is not None]


# --------------------------------------------------------------------------
# CrossDeviceOps
# --------------------------------------------------------------------------
class PushPullCrossDeviceOps(cdo_lib.CrossDeviceOps):
    """Reduces local replicas with add_n, then across workers with push_pull."""

    def __init__(self, num_workers: int, rank: int):
        super().__init__()
        self._num_workers = num_workers
        self._rank = rank
        self._namer = _Namer()
        # graph -> {output tensor name: [push_pull op names]}, to find the
        # push_pull behind a reduced gradient when the optimizer applies it.
        self._sources: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        # graph -> [_Applied]: the gradients the optimizer applied there
        self._applied: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    @property
    def _num_between_graph_workers(self):
        # > 1 disables CrossDeviceOps' shortcut for a single local value,
        # which would skip the cross-worker sum.
        return self._num_workers

    # -- tf.distribute entry points ------------------------------------
    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        del options
        return self._reduce_all(reduce_op, [(per_replica_value, destinations)])[0]

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        del options
        return self._reduce_all(reduce_op, list(value_destination_pairs))

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        del options
        values = list(per_replica_value.values)
        name = self._namer.batch(1)[0]
        with tf.device(values[0].device):
            local = values[0] if len(values) == 1 else tf.concat(values, axis=axis)
            if self._num_workers > 1:
                moved = _move_axis_first(local, axis)
                gathered, _ = allgather_rows(moved, name, self._rank, self._num_workers)
                local = _move_axis_back(gathered, axis)
        return self.broadcast(local, _destinations_or_devices(destinations, per_replica_value))

    # -- the work ------------------------------------------------------
    def _reduce_all(self, reduce_op, pairs):
        names = self._namer.batch(len(pairs))
        results = []
        for (value, destinations), name in zip(pairs, names):
            values = list(value.values) if isinstance(value, values_lib.DistributedValues) \
                else [value]
            total = len(values) * self._num_workers
            dests = _destinations_or_devices(destinations, value)
            if any(isinstance(v, indexed_slices.IndexedSlices) for v in values):
                reduced, pp_ops = self._reduce_sparse(reduce_op, values, name, total)
            else:
                reduced, pp_ops = self._reduce_dense(reduce_op, values, name, total)
            result = self.broadcast(reduced, dests)
            self._remember(result, pp_ops)
            results.append(result)
        return results

    def _reduce_dense(self, reduce_op, values, name, total):
        with tf.device(values[0].device):
            # SyncOnRead variables arrive as their per-replica variables.
            tensors = [tf.convert_to_tensor(v) for v in values]
            local = tensors[0] if len(tensors) == 1 else tf.math.add_n(tensors)
            summed, op = _push_pull(local, name)
            if reduce_op == reduce_util.ReduceOp.MEAN:
                summed = _divide(summed, total)
            elif reduce_op != reduce_util.ReduceOp.SUM:
                raise ValueError(f"BytePSStrategy reduces with SUM or MEAN, not {reduce_op}.")
        return summed, [op] if op is not None else []

    def _reduce_sparse(self, reduce_op, values, name, total):
        if not all(isinstance(v, indexed_slices.IndexedSlices) for v in values):
            # Mixed dense and sparse replicas: the dense sum is exact.
            return self._reduce_dense(reduce_op, values, name, total)
        slices = values
        with tf.device(values[0].device):
            rows = tf.concat([s.values for s in slices], axis=0)
            indices = tf.concat([tf.cast(s.indices, tf.int64) for s in slices], axis=0)
            pp_ops = []
            if self._num_workers > 1:
                rows, rows_ops = allgather_rows(rows, f"{name}/values", self._rank,
                                                self._num_workers)
                indices, index_ops = allgather_rows(indices, f"{name}/indices", self._rank,
                                                    self._num_workers)
                pp_ops = rows_ops + index_ops
            if reduce_op == reduce_util.ReduceOp.MEAN:
                rows = _divide(rows, total)
            indices = tf.cast(indices, slices[0].indices.dtype)
            result = indexed_slices.IndexedSlices(rows, indices, slices[0].dense_shape)
        return result, pp_ops

    # -- which push_pulls serve which gradient --------------------------
    # Priorities are not set here: the C++ priority pass in the op library
    # (bps_tf/ops/priority_pass.cc) ranks the push_pulls of the graph
    # TensorFlow runs. This only records, for inspection, which push_pulls
    # carry the value the optimizer applies to each variable.
    def _remember(self, result, pp_ops):
        if not pp_ops:
            return
        graph = pp_ops[0].graph
        table = self._sources.setdefault(graph, {})
        names = [op.name for op in pp_ops]
        for component in _components(result):
            table[component.name] = names

    def on_apply(self, var, args) -> None:
        """Called when the optimizer applies a reduced value to ``var``
        (``extended.update``): records the push_pulls behind the value."""
        if tf.executing_eagerly():
            return
        graph = tf.compat.v1.get_default_graph()
        table = self._sources.get(graph)
        if not table:
            return
        found = []
        for arg in tf.nest.flatten(args, expand_composites=False):
            for component in _components(arg):
                found += _trace_back(component, table)
        if not found:
            return
        primary = var.values[0] if isinstance(var, values_lib.DistributedValues) else var
        self._applied.setdefault(graph, []).append(_Applied(primary, sorted(set(found))))

    def gradient_priorities(self):
        """[(variable name, push_pull tensor_name, priority)] of the gradients
        applied in each traced graph so far; the priority is the one the
        kernel receives, as the priority pass decided it (None before the
        graph first ran)."""
        from bps_tf.ops import pass_record
        decided = pass_record.priorities()
        out = []
        for graph, applied in list(self._applied.items()):
            for entry in applied:
                for op_name in entry.op_names:
                    name = graph.get_operation_by_name(op_name).get_attr("tensor_name").decode()
                    out.append((entry.label, name, decided.get(name)))
        return out


# --------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------
class _Applied:
    """A gradient the optimizer applied: its variable and push_pulls."""

    __slots__ = ("variable", "label", "op_names")

    def __init__(self, variable, op_names):
        self.variable = variable
        self.label = _variable_label(variable)
        self.op_names = op_names


def _variable_label(var) -> str:
    """A variable's name for reports: Keras path or tf name."""
    path = getattr(var, "path", None)
    if isinstance(path, str) and path:
        return path
    name = getattr(var, "name", "") or ""
    return name[:-2] if name.endswith(":0") else name


def _destinations_or_devices(destinations, value):
    if cdo_lib.check_destinations(destinations):
        return destinations
    return value


def _divide(tensor, n: int):
    if tensor.dtype.is_integer:
        return tf.math.floordiv(tensor, tf.cast(n, tensor.dtype))
    return tensor / tf.cast(n, tensor.dtype)


def _components(value) -> list:
    """The graph tensors a (possibly distributed, possibly sparse) value is made of."""
    if isinstance(value, values_lib.DistributedValues):
        parts = list(value.values)
    else:
        parts = [value]
    out = []
    for part in parts:
        if isinstance(part, indexed_slices.IndexedSlices):
            part = part.values
        if isinstance(part, tf.Tensor) and not tf.executing_eagerly() and hasattr(part, "op"):
            out.append(part)
    return out


def _trace_back(tensor, table: Dict[str, list], depth: int = 8) -> list:
    """Push_pull ops behind ``tensor``, looking through Identity ops (the
    optimizer's value passes through ReplicaContext.all_reduce's
    custom-gradient identities before it reaches extended.update)."""
    for _ in range(depth):
        hit = table.get(tensor.name)
        if hit:
            return hit
        op = tensor.op
        if op.type == "Identity" and op.inputs:
            tensor = op.inputs[0]
        elif op.type == "IdentityN":
            tensor = op.inputs[tensor.value_index]
        else:
            return []
    return []


def _move_axis_first(tensor, axis):
    if axis == 0:
        return tensor
    rank = tensor.shape.rank
    perm = [axis] + [i for i in range(rank) if i != axis]
    return tf.transpose(tensor, perm)


def _move_axis_back(tensor, axis):
    if axis == 0:
        return tensor
    rank = tensor.shape.rank
    perm = list(range(1, axis + 1)) + [0] + list(range(axis + 1, rank))
    return tf.transpose(tensor, perm)


