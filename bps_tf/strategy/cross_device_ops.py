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
every worker without any agreement step: ``naming.StrategyNamer`` numbers the
reduced tensors of each traced graph (``bps.strategy/<graph path>/<n>``, or
``bps.strategy/eager/<i>`` in eager mode: eager calls run one after the
other, and a name may be reused once the previous use finished). Nothing
depends on layer or variable names, which Keras numbers per process and
which therefore differ between a worker that built an extra model and one
that did not. See ``bps_tf.comm.naming``.

Priorities. Reductions that are not gradients block their step
(``collectives.BLOCKING_PRIORITY``); updates of non-trainable state go last
(``collectives.STATE_PRIORITY``); a gradient's priority is set by the C++
priority pass (bps_tf/ops/priority_pass.cc) from the first read of its
variable in the graph TensorFlow runs.
"""
from __future__ import annotations

import weakref
from typing import Dict

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cdo_lib
from tensorflow.python.distribute import reduce_util
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.framework import indexed_slices

from bps_tf.comm import async_training, collectives
from bps_tf.comm import compression as compression_lib
from bps_tf.comm import exchange, naming, reduction
from bps_tf.runtime import elastic_core

# Tensors smaller than this travel uncompressed: they gain nothing, and they
# are the scalars (metrics, loss) whose exact values users read.
FP16_MIN_ELEMENTS = 1024


def allgather_rows(tensor, key: str):
    """Rows of all workers in rank order, sent first; returns (rows, ops).
    Rank and size are read when the graph runs."""
    return exchange.gather_rows(tensor, key, priority=collectives.BLOCKING_PRIORITY,
                                key_per_size=True)


# --------------------------------------------------------------------------
# CrossDeviceOps
# --------------------------------------------------------------------------
class PushPullCrossDeviceOps(cdo_lib.CrossDeviceOps):
    """Reduces local replicas with add_n, then across workers with push_pull."""

    def __init__(self, num_workers: int, rank: int, compression=None):
        super().__init__()
        self._num_workers = num_workers
        self._rank = rank
        compression_lib.check_supported(compression, "BytePSStrategy")
        self._fp16 = compression_lib.is_fp16(compression)
        # core_spec refuses what elastic training cannot roll back, at creation.
        self._core = compression if compression_lib.core_spec(compression) else None
        self._elastic = elastic_core.enabled()
        self._namer = naming.StrategyNamer()
        collectives.load_op_library()   # fail at strategy creation if the library is missing
        # graph -> {output tensor name: [push_pull op names]}, to find the
        # push_pull behind a reduced gradient when the optimizer applies it.
        self._sources: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        # graph -> [_Applied]: the gradients the optimizer applied there
        self._applied: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    @property
    def _num_between_graph_workers(self):
        # > 1 disables CrossDeviceOps' shortcut for a single local value,
        # which would skip the cross-worker sum (an elastic job's graphs
        # must reduce even when traced with one worker left).
        return max(self._num_workers, 2) if self._elastic else self._num_workers

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
            if self._crosses_workers():
                moved = _move_axis_first(local, axis)
                gathered, _ = allgather_rows(moved, name)
                local = _move_axis_back(gathered, axis)
        return self.broadcast(local, _destinations_or_devices(destinations, per_replica_value))

    # -- non-trainable state --------------------------------------------
    def reduce_state(self, reduce_op, value, variable):
        """The MEAN/SUM of a replica-context update of a non-trainable
        variable (moving statistics) over every replica of every worker,
        on the variable's devices. Sent after the gradients
        (``collectives.STATE_PRIORITY``); not ranked as a gradient."""
        with collectives.keep_priority(True):   # the priority pass leaves it last
            return self._reduce_all(reduce_op, [(value, variable)],
                                    priority=collectives.STATE_PRIORITY)[0]

    def broadcast_state(self, tensor):
        """Rank 0's value of ``tensor`` (ONLY_FIRST_REPLICA updates)."""
        name = self._namer.batch(1)[0]
        with collectives.keep_priority(True), collectives.membership_free():
            return collectives.broadcast(tf.convert_to_tensor(tensor), name, root_rank=0,
                                         priority=collectives.STATE_PRIORITY)

    # -- the work ------------------------------------------------------
    def _reduce_all(self, reduce_op, pairs, priority=None):
        names = self._namer.batch(len(pairs))
        if reduce_op == reduce_util.ReduceOp.MEAN:
            op = reduction.Average
        elif reduce_op == reduce_util.ReduceOp.SUM:
            op = reduction.Sum
        else:
            raise ValueError(f"BytePSStrategy reduces with SUM or MEAN, not {reduce_op}.")
        results = []
        for (value, destinations), name in zip(pairs, names):
            values = list(value.values) if isinstance(value, values_lib.DistributedValues) \
                else [value]
            dests = _destinations_or_devices(destinations, value)
            request = self._request(name, op, len(values), priority)
            with tf.device(values[0].device):
                if all(isinstance(v, indexed_slices.IndexedSlices) for v in values):
                    reduced = self._reduce_sparse(request, values)
                else:
                    # SyncOnRead variables arrive as their per-replica variables;
                    # mixed dense and sparse replicas: the dense sum is exact.
                    tensors = [tf.convert_to_tensor(v) for v in values]
                    local = tensors[0] if len(tensors) == 1 else tf.math.add_n(tensors)
                    request.compression = self._compression_for(local, priority)
                    reduced = request.dense(local)
            result = self.broadcast(reduced, dests)
            if priority is None:   # state updates are not gradients
                self._remember(result, request.ops)
            results.append(result)
        return results

    def _request(self, name, op, replicas, priority):
        """The reduction of one value: blocking unless ``priority`` says
        otherwise (state updates go last), averaged over every replica of
        every worker of the membership the step runs in."""
        return reduction.Reduction(
            name, op, replicas=replicas, keep_priority=priority is not None,
            priority=collectives.BLOCKING_PRIORITY if priority is None else priority)

    def _compression_for(self, tensor, priority):
        """The gradients only (reduced inside an optimizer's apply) are
        compressed; state updates (``priority`` set), metrics, counts and a
        user's own reductions stay exact. fp16 takes the large floating ones;
        the engine leaves tensors under BYTEPS_MIN_COMPRESS_BYTES and other
        dtypes uncompressed by itself."""
        if priority is not None or not _gradients_now():
            return None
        if self._fp16:
            size = tensor.shape.num_elements()
            if (tensor.dtype in (tf.float32, tf.float64) and size is not None
                    and size >= FP16_MIN_ELEMENTS):
                return compression_lib.FP16Compressor
            return None
        return self._core or None

    def _reduce_sparse(self, request, slices):
        """Values and indices of the local replicas concatenated, then gathered
        from every worker: exactly the sum a single process computes."""
        if self._crosses_workers():
            return request.sparse(list(slices))
        rows = tf.concat([s.values for s in slices], axis=0)
        indices = tf.concat([tf.cast(s.indices, tf.int64) for s in slices], axis=0)
        if request.op == reduction.Average:
            rows = collectives.divide(rows, request.replicas)
        return indexed_slices.IndexedSlices(rows, tf.cast(indices, slices[0].indices.dtype),
                                            slices[0].dense_shape)

    def _crosses_workers(self) -> bool:
        """Whether reductions go through the servers: with other workers, and
        always in an elastic job (a graph traced alone must still reduce when
        workers join: the membership is read when it runs)."""
        return self._num_workers > 1 or self._elastic

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
        entry = _Applied(primary, sorted(set(found)))
        self._applied.setdefault(graph, []).append(entry)
        label = getattr(var, "bps_label", None) or entry.label
        for op_name in entry.op_names:
            key = graph.get_operation_by_name(op_name).get_attr("tensor_name").decode()
            collectives.label_tensor(key, label)

    def gradient_priorities(self):
        """[(variable name, push_pull tensor_name, priority)] of the gradients
        applied in each traced graph so far; the priority is the one the
        kernel receives, as the priority pass decided it (None before the
        graph first ran)."""
        decided = collectives.decided_priorities()
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
        self.label = naming.variable_name(variable)
        self.op_names = op_names


def _gradients_now() -> bool:
    """Whether the reductions being built now are an optimizer's gradients:
    Keras 3 reduces them inside ``optimizer.apply`` (marked by its hook,
    bps_tf.strategy.keras_hooks). Only those are compressed; a
    ``ReplicaContext.all_reduce`` of the user's, ``strategy.reduce``,
    metrics and SyncBatchNormalization's moments are not."""
    return async_training.in_optimizer_step()


def _destinations_or_devices(destinations, value):
    if cdo_lib.check_destinations(destinations):
        return destinations
    return value


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


