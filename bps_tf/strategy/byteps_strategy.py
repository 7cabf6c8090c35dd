"""BytePSStrategy: Keras 3 ``model.fit`` across workers, unchanged.

    import bps_tf
    strategy = bps_tf.BytePSStrategy()          # joins the cluster (bps_tf.init())
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.Adam(), loss=...)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=...)

Each worker runs the same script (``bpslaunch -np N ...``, or one process per
``TF_CONFIG`` task under a Kubeflow TFJob). ``batch_size`` is the global batch:
sharded by worker, then split over each worker's devices (bps_tf.distribute's
MirroredStrategy: a per-worker batch, as in BytePS).

How it fits tf.distribute: a ``MirroredStrategy`` whose ``MirroredExtended`` knows
the other workers (between-graph, like MultiWorkerMirroredStrategy, which Keras 3
cannot drive: docs/strategy.md) and whose cross-device ops sum through push_pull:

* ``num_replicas_in_sync`` is global (Keras scales the loss by it);
* datasets are sharded with ``InputContext(num_workers, rank)``, and every
  ``get_next`` agrees across workers on the end of the data (without holding
  up a worker that has a batch: bps_tf.strategy.data_check);
* every reduction -- nested structures, host tensors, int32/int64 values,
  SyncOnRead metric variables -- goes across workers, so epoch-end metrics
  and ``evaluate()`` are global and identical on every worker;
* new variables start from rank 0's value (a broadcast inside the initial
  value), so no separate broadcast callback is needed;
* each step's push_pulls overlap the next step's forward pass, layer by
  layer (bps_tf.overlap.fit; ``overlap=False``: the barrier); the variable
  the forward pass reads first leaves first (with the barrier, the C++
  priority pass, bps_tf/ops/priority_pass.cc, sets that order);
* rank 0 alone is ``should_checkpoint`` / ``should_save_summary``; Keras'
  ``ModelCheckpoint`` and ``BackupAndRestore`` write on rank 0 only;
* XLA is kept off for models under the strategy (the op has no XLA kernel).

Rules: create the model *and* the optimizer under ``scope()``; every worker
creates the same variables in the same order; shuffle with the same seed on
every worker (``keras.utils.set_random_seed``). ``model.predict(x)`` returns
the predictions of all of ``x`` on every worker (``predict="shard"``: this
worker's shard). Moving statistics are averaged over every replica of every
worker, so every weight is identical everywhere.
"""
from __future__ import annotations

import tensorflow as tf

from bps_tf.comm import async_training
from bps_tf.comm import compression as compression_lib
from bps_tf.comm.compression import Compression
from bps_tf.overlap import fit as overlap_fit
from bps_tf.runtime import elastic_core
from bps_tf.strategy import choices as strategy_choices
from bps_tf.strategy import data_check, keras_hooks
from bps_tf.strategy.cluster_resolver import make_cluster_resolver
from bps_tf.strategy.cross_device_ops import PushPullCrossDeviceOps
from bps_tf.strategy.extended import AsyncBytePSExtended, BytePSExtended
from bps_tf.strategy.predictions import gather_predictions

PREDICT_MODES = ("all", "shard")
MODES = ("sync", "async")

__all__ = ["BytePSStrategy", "BytePSExtended", "PushPullCrossDeviceOps", "gather_predictions"]


class BytePSStrategy(tf.distribute.MirroredStrategy):
    """Synchronous (or, with ``mode="async"``, asynchronous parameter-server)
    data parallelism over bps_tf workers and their local devices.

    ``devices``: this worker's devices (default: its GPUs, else its CPU). The cluster
    comes from ``bps_tf.init()`` (``DMLC_*`` or ``TF_CONFIG``), called here if need be.

    ``predict``: ``"all"`` (default) -- ``model.predict(x)`` returns the predictions
    of every row of ``x``, in order, on every worker; ``"shard"`` -- Keras' own
    behaviour under a strategy: each worker gets those of its shard of every batch.

    ``sync_state``: True (default) averages the replica-context updates of
    non-trainable floating variables created without an aggregation
    (BatchNormalization's moving statistics) over all replicas of all
    workers, so every worker holds the same model; False keeps each
    replica's own (Keras 3 under MirroredStrategy).

    ``mode``: ``"sync"`` (default) or ``"async"``: asynchronous
    parameter-server training (AsyncBytePSExtended below); the default follows
    BytePS's switch ``BYTEPS_ENABLE_ASYNC=1``. Every worker must use the
    same mode (checked at construction).

    ``compression``: ``Compression.fp16`` sends float reductions of at least
    1,024 elements as float16, scaled so no sum overflows; the core's
    compressors (``Compression.onebit()``, ``.topk()``, ``.randomk()``,
    ``.dithering()``, docs/compression.md) apply to float32 reductions of at
    least BYTEPS_MIN_COMPRESS_BYTES. State updates stay exact.

    ``overlap``: True -- ``model.fit`` overlaps each step's push_pulls with
    the next step's forward pass, layer by layer, bit-identical to the
    barrier (docs/overlap.md); models it cannot serve exactly keep the barrier
    (one log line). None: ``BYTEPS_OVERLAP`` (default 1; off in async mode).
    Every worker must choose the same.
    """

    _sync_extended = BytePSExtended  # bps_tf.distribute.MirroredStrategy feeds workers apart
    bps_tf_strategy = True           # bps_tf.strategy.identity: the Keras hooks act for it

    def __init__(self, devices=None, predict="all", sync_state=True, compression=None,
                 mode=None, overlap=None, elastic=False):
        if elastic != elastic_core.enabled():
            raise ValueError(
                "BytePSStrategy(elastic=True) needs an elastic job (bpslaunch --min-np/--max-np "
                "or BYTEPS_ELASTIC=1 on every node)" if elastic else
                "BYTEPS_ELASTIC=1: pass BytePSStrategy(elastic=True), so that model.fit "
                "survives membership changes (docs/elastic.md); without it the first change "
                "would end fit with an error.")
        if elastic and overlap:
            raise ValueError("BytePSStrategy(elastic=True, overlap=True): an overlapped step's "
                             "update is applied during the next step, so a membership change "
                             "would find it half applied; elastic training keeps the barrier.")
        if elastic and mode == "async":
            raise ValueError("BytePSStrategy(elastic=True, mode='async'): the servers hold the "
                             "only shared weights; there is no commit to roll back to.")
        if elastic:
            overlap = False
        self.elastic = bool(elastic)
        if predict not in PREDICT_MODES:
            raise ValueError(f"BytePSStrategy(predict={predict!r}): expected one of "
                             f"{', '.join(map(repr, PREDICT_MODES))}.")
        if mode is None:
            mode = "async" if async_training.enabled() else "sync"
        if mode not in MODES:
            raise ValueError(f"BytePSStrategy(mode={mode!r}): expected 'sync' or 'async'.")
        if overlap not in (None, True, False):
            raise ValueError(f"BytePSStrategy(overlap={overlap!r}): expected True, False or None.")
        self.predict_mode = predict
        self.mode = mode
        self.compression = compression if compression is not None else Compression.none
        self.compression_fp16 = compression_lib.is_fp16(compression)
        # Read by overlap_fit: the overlapped push_pulls travel uncompressed.
        self.compressed = compression not in (None, Compression.none)
        if overlap and self.compressed:
            what = "fp16" if self.compression_fp16 else repr(compression)
            raise ValueError(f"BytePSStrategy(overlap=True, compression={what}): the overlapped "
                             "push_pulls travel uncompressed; choose one of them.")
        if overlap and mode == "async":
            raise ValueError("BytePSStrategy(overlap=True, mode='async'): asynchronous training "
                             "has no step barrier to overlap; choose one of them.")
        cls = AsyncBytePSExtended if mode == "async" else self._sync_extended
        extended = cls(self, devices=devices, sync_state=sync_state, compression=compression,
                       **({"elastic": True} if elastic else {}))
        tf.distribute.Strategy.__init__(self, extended)  # pylint: disable=non-parent-init-called
        self._bps_cluster_resolver = None
        keras_hooks.install()
        wanted = strategy_choices.overlap_wanted(mode == "async", overlap)
        # Without its hooks (a Keras that moved them) the overlap stays off:
        # the barrier gives the same weights (one warning names the hooks).
        wanted = wanted and overlap_fit.install()
        self.overlap, early_check = strategy_choices.agreed(
            mode == "async", wanted, len(extended.worker_devices))
        # Workers with a batch of their own do not wait for the per-step
        # end-of-data sum (bps_tf.strategy.data_check).
        extended.bps_early_data_check = early_check and extended._in_multi_worker_mode()
        data_check.install()

    @property
    def cluster_resolver(self):
        """This process's ``task_type``, ``task_id`` and ``cluster_spec()``, as
        TensorFlow's multi-worker strategies report them (see
        bps_tf/strategy/cluster_resolver.py for the DMLC and single-process cases)."""
        if self._bps_cluster_resolver is None:
            self._bps_cluster_resolver = make_cluster_resolver()
        return self._bps_cluster_resolver

    @property
    def num_workers(self) -> int:
        return self.extended._num_workers  # pylint: disable=protected-access

    @property
    def rank(self) -> int:
        return self.extended._rank  # pylint: disable=protected-access

    def __repr__(self):
        return (f"BytePSStrategy(rank={self.rank}, workers={self.num_workers}, "
                f"devices={list(self.extended.worker_devices)})")

