"""BytePSStrategy: Keras 3 ``model.fit`` across workers, unchanged.

    import bps_tf
    strategy = bps_tf.BytePSStrategy()          # joins the cluster (bps_tf.init())
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.Adam(), loss=...)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=...)

Each worker runs the same script (``bpslaunch -np N ...``, or one process
per ``TF_CONFIG`` task under a Kubeflow TFJob). ``batch_size`` is the global
batch: the data is sharded by worker, then split over each worker's devices.

How it fits tf.distribute: a ``MirroredStrategy`` whose ``MirroredExtended``
knows about the other workers (between-graph replication, like
MultiWorkerMirroredStrategy, which Keras 3 cannot drive: see docs/strategy.md)
and whose cross-device ops sum through push_pull (bps_tf._strategy_ops):

* ``num_replicas_in_sync`` is global (Keras scales the loss by it);
* datasets are sharded with ``InputContext(num_workers, rank)``, and every
  ``get_next`` agrees across workers on the end of the data;
* every reduction -- nested structures, host tensors, int32/int64 values,
  SyncOnRead metric variables -- goes across workers, so epoch-end metrics
  and ``evaluate()`` are global and identical on every worker;
* new variables start from rank 0's value (a broadcast inside the initial
  value), so no separate broadcast callback is needed;
* gradients get push_pull priorities from the graph TensorFlow runs (the
  C++ priority pass, bps_tf/ops/priority_pass.cc): the variable read first
  in the forward pass first;
* rank 0 alone is ``should_checkpoint`` / ``should_save_summary``; Keras'
  ``ModelCheckpoint`` and ``BackupAndRestore`` write on rank 0 only
  (bps_tf._strategy_keras);
* XLA is kept off for models under the strategy (the op has no XLA kernel).

Rules: create the model *and* the optimizer under ``scope()``; every worker
creates the same variables in the same order; shuffle with the same seed on
every worker (``keras.utils.set_random_seed``) so the shards partition the
data. ``model.predict`` returns this worker's shard only: use
:func:`gather_predictions` for all rows.
"""
from __future__ import annotations

import sys
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cdo_lib
from tensorflow.python.distribute import distribute_lib, distribute_utils
from tensorflow.python.distribute import input_util, mirrored_strategy, reduce_util
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.trackable import base as trackable_base

from bps_tf import basics, cluster
from bps_tf import _strategy_keras
from bps_tf._strategy_ops import (PushPullCrossDeviceOps, allgather_rows,
                                  broadcast_from_root, next_init_name)

__all__ = ["BytePSStrategy", "BytePSExtended", "PushPullCrossDeviceOps", "gather_predictions"]


class BytePSExtended(mirrored_strategy.MirroredExtended):
    """MirroredExtended for one worker of a between-graph BytePS job."""

    def __init__(self, container_strategy, devices=None):
        _join_cluster()
        self._num_workers = basics.size()
        self._rank = basics.rank()
        ops = PushPullCrossDeviceOps(self._num_workers, self._rank)
        super().__init__(container_strategy, devices=devices, cross_device_ops=ops)
        self._push_pull_ops = ops

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
        # Keras passes nested structures (its first batch) to reduce().
        def reduce_one(v):
            if distribute_utils.is_mirrored(v) and reduce_op == reduce_util.ReduceOp.MEAN:
                return v
            if not isinstance(v, values_lib.DistributedValues):
                if self._num_workers == 1:
                    return cdo_lib.reduce_non_distributed_value(
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
        if not isinstance(value, values_lib.DistributedValues) and self._num_workers == 1:
            return value
        return self._cross_device_ops._gather(value, destinations=destinations,  # pylint: disable=protected-access
                                              axis=axis, options=options)

    def _update(self, var, fn, args, kwargs, group):
        # The optimizer applies a reduced gradient: note which push_pulls
        # carry it (for gradient_priorities(); the C++ pass ranks them).
        self._push_pull_ops.on_apply(var, args)
        return super()._update(var, fn, args, kwargs, group)

    # -- input -------------------------------------------------------------
    def _input_context(self):
        return distribute_lib.InputContext(num_input_pipelines=self._num_workers,
                                           input_pipeline_id=self._rank,
                                           num_replicas_in_sync=self._num_replicas_in_sync)

    def _experimental_distribute_dataset(self, dataset, options):
        if (options and options.experimental_replication_mode ==
                distribute_lib.InputReplicationMode.PER_REPLICA):
            raise NotImplementedError("InputReplicationMode.PER_REPLICA works with "
                                      "distribute_datasets_from_function only.")
        return input_util.get_distributed_dataset(
            dataset, self._input_workers_with_options(options), self._container_strategy(),
            num_replicas_in_sync=self._num_replicas_in_sync,
            input_context=self._input_context(), options=options)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        if (options and options.experimental_replication_mode ==
                distribute_lib.InputReplicationMode.PER_REPLICA):
            raise NotImplementedError("InputReplicationMode.PER_REPLICA is not supported "
                                      "by BytePSStrategy.")
        return input_util.get_distributed_datasets_from_function(
            dataset_fn, self._input_workers_with_options(options), [self._input_context()],
            self._container_strategy(), options=options)

    def _experimental_distribute_values_from_function(self, value_fn):
        per_replica = []
        for local_id in range(len(self._devices)):
            context = distribute_lib.ValueContext(
                self._get_replica_id_in_sync_group(local_id), self._num_replicas_in_sync)
            per_replica.append(value_fn(context))
        return distribute_utils.regroup(per_replica, always_wrap=True)

    # -- variables -----------------------------------------------------------
    def _get_variable_creator_initial_value(self, replica_id, device, primary_var, **kwargs):
        # Replica 0 of every worker takes rank 0's initial value; the other
        # local replicas copy replica 0 (MirroredExtended). SyncOnRead
        # variables (metrics) hold per-replica partial values: left alone.
        if (replica_id != 0 or self._num_workers == 1 or
                kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ):
            return super()._get_variable_creator_initial_value(
                replica_id=replica_id, device=device, primary_var=primary_var, **kwargs)
        initial_value = kwargs["initial_value"]
        dtype = kwargs.get("dtype")
        name = next_init_name()   # claimed now, in creation order

        def initial_value_fn():
            with tf.device(device):
                value = initial_value() if callable(initial_value) else initial_value
                if isinstance(value, trackable_base.CheckpointInitialValue):
                    value = value.wrapped_value
                value = tf.convert_to_tensor(value, dtype=dtype)
                if value.dtype in (tf.string, tf.resource, tf.variant):
                    return value
                return broadcast_from_root(value, name)
        return initial_value_fn


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
        from bps_tf import server
        sys.exit(server.main())
    basics.init()


class BytePSStrategy(tf.distribute.MirroredStrategy):
    """Synchronous data parallelism over bps_tf workers and their local devices.

    ``devices``: this worker's devices (default: its GPUs, else its CPU).
    The cluster comes from ``bps_tf.init()`` (bpslaunch's ``DMLC_*`` or
    ``TF_CONFIG``), called here if the script has not called it.
    """

    def __init__(self, devices=None):
        extended = BytePSExtended(self, devices=devices)
        tf.distribute.Strategy.__init__(self, extended)  # pylint: disable=non-parent-init-called
        _strategy_keras.install()

    @property
    def num_workers(self) -> int:
        return self.extended._num_workers  # pylint: disable=protected-access

    @property
    def rank(self) -> int:
        return self.extended._rank  # pylint: disable=protected-access

    def __repr__(self):
        return (f"BytePSStrategy(rank={self.rank}, workers={self.num_workers}, "
                f"devices={list(self.extended.worker_devices)})")


# --------------------------------------------------------------------------
# Predictions from every worker
# --------------------------------------------------------------------------
def gather_predictions(model, x, batch_size: int = 256):
    """``model``'s predictions for all rows of ``x``, in order, on every worker.

    ``model.predict`` under the strategy returns only this worker's shard.
    Here each worker predicts a contiguous block of rows (worker r: rows
    ``[r*n/N, (r+1)*n/N)``) by calling the model in batches, and the blocks
    are gathered in rank order. ``x``: an array, a tensor, or a
    structure of them; every worker must pass the same ``x`` and call this
    at the same point of the program. Returns numpy arrays (the model's
    output structure).
    """
    flat_x = [np.asarray(a) for a in tf.nest.flatten(x)]
    n = len(flat_x[0])
    size, rank = (basics.size(), basics.rank()) if basics.is_initialized() else (1, 0)
    lo, hi = rank * n // size, (rank + 1) * n // size
    predict = _predict_function(model)
    outputs, structure = [], None
    for start in range(lo, hi, batch_size):
        batch = tf.nest.pack_sequence_as(x, [a[start:min(hi, start + batch_size)]
                                             for a in flat_x])
        structure = predict(batch)
        outputs.append([np.asarray(o) for o in tf.nest.flatten(structure)])
    if not outputs:   # this worker has no rows: learn the output shapes
        structure = predict(tf.nest.pack_sequence_as(x, [a[:1] for a in flat_x]))
        outputs.append([np.asarray(o)[:0] for o in tf.nest.flatten(structure)])
    local = [np.concatenate(parts, axis=0) for parts in zip(*outputs)]
    if size == 1:
        return tf.nest.pack_sequence_as(structure, local)
    gathered = [allgather_rows(tf.convert_to_tensor(a), f"bps.strategy/predict/{i}",
                               rank, size)[0].numpy() for i, a in enumerate(local)]
    return tf.nest.pack_sequence_as(structure, gathered)



# model -> its prediction function. The function holds the model weakly, so
# the cache does not keep models alive (and nothing is set on the model,
# where Keras would track it).
_predict_functions: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _predict_function(model):
    fn = _predict_functions.get(model)
    if fn is None:
        ref = weakref.ref(model)
        fn = tf.function(lambda batch: ref()(batch, training=False), reduce_retracing=True)
        _predict_functions[model] = fn
    return fn
