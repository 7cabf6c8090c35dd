"""The extended classes behind BytePSStrategy (tf.distribute's
``StrategyExtended``): who this worker is among all replicas, reductions
that always cross workers, sharded input, and variables that start from rank
0's value. ``AsyncBytePSExtended`` serves ``mode="async"``.
"""
from __future__ import annotations

import contextlib
import sys
import weakref

import numpy as np
import tensorflow as tf

from bps_tf.comm import async_training, collectives, naming
from bps_tf.comm.compression import Compression
from bps_tf.comm import lifecycle
from bps_tf.hooks import tf_internals
from bps_tf.runtime import basics, cluster
from bps_tf.strategy import batch_share, keras_hooks
from bps_tf.strategy.cross_device_ops import PushPullCrossDeviceOps

__all__ = ["BytePSExtended", "AsyncBytePSExtended"]


class BytePSExtended(tf_internals.MIRRORED.MirroredExtended):
    """MirroredExtended for one worker of a between-graph BytePS job."""

    def __init__(self, container_strategy, devices=None, sync_state=True, compression=None,
                 elastic=False):
        _join_cluster()
        # Elastic: variables start from their own initial values and the
        # elastic fit syncs them from rank 0 (a newcomer builds its model
        # while the others train: no creation-time broadcast could pair).
        self._bps_elastic = bool(elastic)
        self._sync_state = bool(sync_state)
        self._num_workers = basics.size()
        self._rank = basics.rank()
        ops = self._make_cross_device_ops(compression)
        super().__init__(container_strategy, devices=devices, cross_device_ops=ops)
        self._push_pull_ops = ops

    def _make_cross_device_ops(self, compression):
        return PushPullCrossDeviceOps(self._num_workers, self._rank, compression)

    def bps_follow_membership(self) -> None:
        """Elastic: the worker count and rank of the membership just joined."""
        self._num_workers, self._rank = basics.size(), basics.rank()
        ops = self._push_pull_ops
        ops._num_workers, ops._rank = self._num_workers, self._rank  # pylint: disable=protected-access

    def _call_for_each_replica(self, fn, args, kwargs):
        # Each replica's share of the batch, for the loss weighting
        # (bps_tf.strategy.batch_share); a tf.function keeps its own path.
        if self._num_replicas_in_sync > 1:
            fn = batch_share.recording(fn)
        return super()._call_for_each_replica(fn, args, kwargs)

    # -- who we are ------------------------------------------------------
    @property
    def _num_replicas_in_sync(self):
        return len(self._devices) * self._num_workers

    def _in_multi_worker_mode(self):
        # Turns on input_lib's cross-worker end-of-data agreement.
        return self._num_workers > 1

    @property
    def experimental_between_graph(self):
        return True

    @property
    def should_checkpoint(self):
        return self._rank == 0

    @property
    def should_save_summary(self):
        return self._rank == 0

    def _get_replica_id_in_sync_group(self, replica_id):
        return self._rank * len(self._devices) + replica_id

    def _get_local_replica_id(self, replica_id_in_sync_group):
        return replica_id_in_sync_group - self._rank * len(self._devices)

    # -- reductions: always ours ------------------------------------------
    def _use_merge_call(self):
        # merge_call everywhere: the replica-context path without it needs
        # collectives that XLA compiles, and push_pull has no XLA kernel.
        return True

    def _get_cross_device_ops(self, value):
        # MirroredExtended sends int32 values to a local-only reduction.
        del value
        return self._cross_device_ops

    def _reduce_to(self, reduce_op, value, destinations, options):
        if batch_share.symbolic_build():
            # Keras' first batch, reduced only for its shapes: this worker's
            # first replica's (the replicas' shares may differ in size).
            return tf.nest.map_structure(
                lambda v: self._local_results(v)[0]
                if isinstance(v, tf.distribute.DistributedValues) else v, value)
        # Keras passes nested structures (its first batch) to reduce().
        state = _is_state_variable(destinations)

        def reduce_one(v):
            if (tf_internals.DISTRIBUTE_UTILS.is_mirrored(v)
                    and reduce_op == tf.distribute.ReduceOp.MEAN):
                return v
            if state:
                # A replica-context update of a non-trainable variable
                # (moving statistics): sent after every gradient.
                return self._push_pull_ops.reduce_state(reduce_op, v, destinations)
            if not isinstance(v, tf.distribute.DistributedValues):
                if self._num_workers == 1:
                    return tf_internals.CROSS_DEVICE_OPS.reduce_non_distributed_value(
                        reduce_op, v, destinations, len(self._devices))
                # One value for this worker (input_lib's end-of-data count):
                # one contribution per worker.
                v = tf.convert_to_tensor(v)
            return self._cross_device_ops.reduce(reduce_op, v, destinations=destinations,
                                                 options=options)
        return tf.nest.map_structure(reduce_one, value)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        return self._cross_device_ops.batch_reduce(reduce_op, value_destination_pairs,
                                                   options=options)

    def _gather_to_implementation(self, value, destinations, axis, options):
        if self._num_workers == 1 and not isinstance(value, tf.distribute.DistributedValues):
            return value
        return self._cross_device_ops._gather(value, destinations=destinations,  # pylint: disable=protected-access
                                              axis=axis, options=options)

    def _broadcast_to(self, tensor, destinations):
        # ONLY_FIRST_REPLICA updates in replica context: the first replica of
        # rank 0, not of each worker, so every worker holds the same value.
        if self._num_workers > 1 and _is_state_variable(destinations, trainable_too=True) \
                and not isinstance(tensor, (int, float)):
            tensor = self._push_pull_ops.broadcast_state(tensor)
        return super()._broadcast_to(tensor, destinations)

    def _update(self, var, fn, args, kwargs, group):
        # The optimizer applies a reduced gradient: note which push_pulls
        # carry it (for gradient_priorities(); the C++ pass ranks them).
        if getattr(var, "trainable", True):
            self._push_pull_ops.on_apply(var, args)
        return super()._update(var, fn, args, kwargs, group)

    # -- input -------------------------------------------------------------
    def _input_context(self):
        return tf.distribute.InputContext(num_input_pipelines=self._num_workers,
                                           input_pipeline_id=self._rank,
                                           num_replicas_in_sync=self._num_replicas_in_sync)

    def _experimental_distribute_dataset(self, dataset, options):
        if (options and options.experimental_replication_mode ==
                tf.distribute.InputReplicationMode.PER_REPLICA):
            raise NotImplementedError("InputReplicationMode.PER_REPLICA works with "
                                      "distribute_datasets_from_function only.")
        context = self._input_context()
        return tf_internals.INPUT_UTIL.get_distributed_dataset(
            dataset, self._input_workers_with_options(options), self._container_strategy(),
            num_replicas_in_sync=context.num_replicas_in_sync, input_context=context,
            options=options)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        if (options and options.experimental_replication_mode ==
                tf.distribute.InputReplicationMode.PER_REPLICA):
            raise NotImplementedError("InputReplicationMode.PER_REPLICA is not supported "
                                      "by BytePSStrategy.")
        return tf_internals.INPUT_UTIL.get_distributed_datasets_from_function(
            dataset_fn, self._input_workers_with_options(options), [self._input_context()],
            self._container_strategy(), options=options)

    def _experimental_distribute_values_from_function(self, value_fn):
        per_replica = []
        for local_id in range(len(self._devices)):
            context = tf.distribute.experimental.ValueContext(
                self._get_replica_id_in_sync_group(local_id), self._num_replicas_in_sync)
            per_replica.append(value_fn(context))
        return tf_internals.DISTRIBUTE_UTILS.regroup(per_replica, always_wrap=True)

    # -- variables -----------------------------------------------------------
    def _create_variable(self, next_creator, **kwargs):
        per_replica = _unaggregated_state(kwargs) and not _an_optimizer_is_building()
        if self._sync_state and self._num_replicas_in_sync > 1 and per_replica:
            # Keras 3 creates BatchNormalization's moving statistics (and any
            # add_weight(trainable=False)) with aggregation NONE: each replica
            # would keep its own. tf.keras declared them MEAN, which makes
            # their replica-context updates an average over all replicas.
            kwargs["aggregation"] = tf.VariableAggregation.MEAN
            per_replica = False
        variable = super()._create_variable(next_creator, **kwargs)
        # What errors and the timeline call its push_pulls (never a key).
        variable.bps_label = naming.display_path(kwargs.get("name"))
        # Each replica's own by the user's choice (sync_state=False): the
        # replica fingerprint leaves it out (bps_tf.strategy.drift_check).
        variable.bps_per_replica = per_replica
        return variable

    def _get_variable_creator_initial_value(self, replica_id, device, primary_var, **kwargs):
        # Replica 0 of every worker takes rank 0's initial value; the other
        # local replicas copy replica 0 (MirroredExtended). SyncOnRead
        # variables (metrics) hold per-replica partial values: left alone.
        if (replica_id != 0 or self._num_workers == 1 or self._bps_elastic or
                kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ):
            return super()._get_variable_creator_initial_value(
                replica_id=replica_id, device=device, primary_var=primary_var, **kwargs)
        initial_value = kwargs["initial_value"]
        dtype = kwargs.get("dtype")
        key = naming.next_init_key()   # claimed now, in creation order
        if kwargs.get("name"):
            collectives.label_tensor(key, naming.display_path(kwargs["name"]))
        # Keys pair variables by creation order; the variable's identity
        # rides along, so workers that created different variables at this
        # position (a rank-dependent layer, another build order) fail at
        # once, naming both, instead of pairing equal-shaped weights wrongly.
        identity = naming.variable_identity(naming.display_path(kwargs.get("name")))

        def initial_value_fn():
            with tf.device(device):
                value = initial_value() if callable(initial_value) else initial_value
                if isinstance(value, tf_internals.TRACKABLE.CheckpointInitialValue):
                    value = value.wrapped_value
                value = tf.convert_to_tensor(value, dtype=dtype)
                if value.dtype in (tf.string, tf.resource, tf.variant):
                    return value
                with collectives.agreement_scope(var=identity):
                    return collectives.broadcast(value, key, root_rank=0)
        return initial_value_fn


def _unaggregated_state(kwargs) -> bool:
    """A non-trainable floating ON_WRITE variable without an aggregation."""
    synchronization = kwargs.get("synchronization") or tf.VariableSynchronization.AUTO
    aggregation = kwargs.get("aggregation") or tf.VariableAggregation.NONE
    dtype = kwargs.get("dtype")
    initial_value = kwargs.get("initial_value")
    if dtype is None and initial_value is not None and not callable(initial_value):
        dtype = getattr(initial_value, "dtype", None)
        if dtype is None:   # a Python number or list: float32, as tf.Variable makes it
            dtype = tf.float32 if np.asarray(initial_value).dtype.kind == "f" else None
    return (kwargs.get("trainable") is False and aggregation == tf.VariableAggregation.NONE
            and synchronization in (tf.VariableSynchronization.AUTO,
                                    tf.VariableSynchronization.ON_WRITE)
            and dtype is not None and tf.as_dtype(dtype).is_floating)


def _an_optimizer_is_building() -> bool:
    """True while a Keras optimizer creates its own variables. They are
    updated in cross-replica context, or (the loss scale) identically on every
    replica inside a cond, where a MEAN aggregation's merge_call cannot run."""
    return keras_hooks.optimizer_building() is not None


def _is_state_variable(destinations, trainable_too: bool = False) -> bool:
    """True if ``destinations`` is a mirrored (ON_WRITE) variable being
    updated with an aggregation: the merge step of a replica-context assign."""
    if not isinstance(destinations, tf_internals.VALUES.DistributedVariable):
        return False
    if isinstance(destinations, tf_internals.VALUES.SyncOnReadVariable):
        return False
    return trainable_too or not destinations.trainable


def _join_cluster() -> None:
    """bps_tf.init(), unless done; a server task serves instead, then exits.

    Under a TFJob every replica may run the training script: a ``ps`` task
    (DMLC_ROLE=server) has nothing to train, so it runs its server here
    until the workers finish and ends the process with the server's exit
    code, as a ParameterServerStrategy ps task blocks in ``join()``.
    """
    if basics.is_initialized():
        return
    if cluster.resolve().role in ("server", "scheduler"):
        from bps_tf.runtime import server
        sys.exit(server.main())
    lifecycle.init()


class AsyncBytePSExtended(BytePSExtended):
    """``mode="async"``: each worker is its own trainer (bps_tf.comm.async_training).

    The strategy spans only this worker's devices: the loss is scaled by
    the local replica count, ``batch_size`` is this worker's batch,
    reductions (metrics, end of data) stay on this worker, and a trainable
    variable's optimizer update is followed by push change / pull weights
    under the variable's ``bps_async/`` key. Inside ``local_input()`` (which
    ``fit``, ``evaluate`` and ``predict`` enter: keras_hooks; ``fit``
    splits arrays by worker itself) datasets are not sharded; elsewhere
    they are sharded by rank.
    """

    def __init__(self, container_strategy, devices=None, sync_state=True, compression=None):
        if compression not in (None, Compression.none):
            raise ValueError("BytePSStrategy(mode='async'): compression is not supported "
                             "(the servers keep full-precision parameters).")
        self._unsharded = 0
        self._counted = weakref.WeakSet()
        super().__init__(container_strategy, devices=devices, sync_state=sync_state)
        if len(self._devices) > 1:
            raise NotImplementedError(
                "BytePSStrategy(mode='async') trains one device per worker process (got "
                f"{list(self._devices)}): start one worker per GPU (bpslaunch -np <GPUs>).")

    def _make_cross_device_ops(self, compression):
        return tf.distribute.ReductionToOneDevice()

    @property
    def _num_replicas_in_sync(self):
        return len(self._devices)

    def _in_multi_worker_mode(self):
        return False

    def _get_replica_id_in_sync_group(self, replica_id):
        return replica_id

    def _get_local_replica_id(self, replica_id_in_sync_group):
        return replica_id_in_sync_group

    _MIRRORED = tf_internals.MIRRORED.MirroredExtended

    def _get_cross_device_ops(self, value):
        return self._MIRRORED._get_cross_device_ops(self, value)  # pylint: disable=protected-access

    def _reduce_to(self, reduce_op, value, destinations, options):
        return self._MIRRORED._reduce_to(self, reduce_op, value, destinations, options)  # pylint: disable=protected-access

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        return self._MIRRORED._batch_reduce_to(self, reduce_op, value_destination_pairs,  # pylint: disable=protected-access
                                               options)

    def _gather_to_implementation(self, value, destinations, axis, options):
        return self._MIRRORED._gather_to_implementation(self, value, destinations, axis,  # pylint: disable=protected-access
                                                        options)

    def _broadcast_to(self, tensor, destinations):
        return self._MIRRORED._broadcast_to(self, tensor, destinations)  # pylint: disable=protected-access

    def _update(self, var, fn, args, kwargs, group):
        # Weight decay and the update proper are two updates of one step:
        # each pushes its own change (their sum is the step's change).
        if (not async_training.in_optimizer_step() or not getattr(var, "trainable", False)
                or getattr(var, "bps_async_key", None) is None):
            return self._MIRRORED._update(self, var, fn, args, kwargs, group)  # pylint: disable=protected-access
        # One step counter per traced step: with the first variable updated.
        graph = tf.compat.v1.get_default_graph()
        count_step = not tf.executing_eagerly() and graph not in self._counted
        if count_step:
            self._counted.add(graph)
        fn = async_training.exchanging(fn, var.bps_async_key, var, count_step)
        return self._MIRRORED._update(self, var, fn, args, kwargs, group)  # pylint: disable=protected-access

    def _input_context(self):
        if self._unsharded:
            return tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                               num_replicas_in_sync=self._num_replicas_in_sync)
        return super()._input_context()

    @contextlib.contextmanager
    def local_input(self):
        """Datasets distributed inside are not sharded by worker
        (``evaluate``/``predict``: every worker sees all of ``x``)."""
        self._unsharded += 1
        try:
            yield
        finally:
            self._unsharded -= 1

    def _create_variable(self, next_creator, **kwargs):
        variable = super()._create_variable(next_creator, **kwargs)
        if kwargs.get("trainable", True) and getattr(variable, "trainable", False):
            variable.bps_async_key = naming.next_async_variable_key()
        return variable
