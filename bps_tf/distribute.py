"""``bps_tf.distribute.MirroredStrategy``: BytePS's strategy of that name.

    import bps_tf as bps                      # was: import byteps.tensorflow as bps
    strategy = bps.distribute.MirroredStrategy(devices=["/gpu:0"])
    with strategy.scope():
        model = make_model(); model.compile(...)
    model.fit(per_worker_dataset, ...)

BytePS's MirroredStrategy mirrors the model on this worker's devices and sums
the gradients of every worker through the servers, like BytePSStrategy. What
differs is the input: each worker trains on its own batches. A dataset is not
sharded across workers, and ``batch_size`` is this worker's batch, split over
its devices. A step therefore trains on the batches of all workers, and the
gradients are averaged over all of them. BytePSStrategy instead treats
``batch_size`` as the global batch and shards it by worker.

Everything else is BytePSStrategy's: variables start from rank 0's values,
``num_replicas_in_sync`` counts the replicas of every worker (Keras scales
the loss by it, which makes the gradient the mean over all workers' samples),
metrics and ``evaluate()`` are reduced over every worker, and ``predict``
defaults to ``"shard"``: on unsharded input, each worker's own predictions
of all of ``x``.
"""
from __future__ import annotations

import tensorflow as tf

from bps_tf.strategy import BytePSExtended, BytePSStrategy

__all__ = ["MirroredStrategy"]


class PerWorkerInputExtended(BytePSExtended):
    """BytePSExtended whose datasets are this worker's alone."""

    def _input_context(self):
        # One input pipeline: nothing is sharded by worker; each batch is
        # split over this worker's devices only.
        return tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                           num_replicas_in_sync=len(self._devices))


class MirroredStrategy(BytePSStrategy):
    """BytePS's ``byteps.tensorflow.distribute.MirroredStrategy``: per-worker
    batches, gradients averaged over every worker through the servers.

    ``devices``: this worker's devices (default: its GPUs, else its CPU).
    ``predict``: only "shard" (each worker's own predictions; "all" is refused).
    ``cross_device_ops``: BytePS's argument; the reduction here is always
    bps_tf's push_pull, so any value other than None is refused. Other
    keywords are BytePSStrategy's (``compression``, ``sync_state``, ``mode``:
    asynchronous training feeds every worker apart too).
    """

    _sync_extended = PerWorkerInputExtended

    def __init__(self, devices=None, cross_device_ops=None, **options):
        if cross_device_ops is not None:
            raise ValueError(
                "bps_tf.distribute.MirroredStrategy(cross_device_ops=...): the reduction "
                "across devices and workers is always bps_tf's push_pull through the "
                "servers; leave cross_device_ops unset.")
        if options.setdefault("predict", "shard") != "shard":
            # "all" gathers the workers' shards of one x; here each worker's
            # x is whole, so the gather would repeat every row size() times.
            raise ValueError(
                f"bps_tf.distribute.MirroredStrategy(predict={options['predict']!r}): each "
                "worker feeds its own data, so predict returns each worker's own predictions "
                "(predict='shard'); use BytePSStrategy for predictions of one shared x.")
        super().__init__(devices=devices, **options)

    def __repr__(self):
        return (f"bps_tf.distribute.MirroredStrategy(rank={self.rank}, "
                f"workers={self.num_workers}, devices={list(self.extended.worker_devices)})")
