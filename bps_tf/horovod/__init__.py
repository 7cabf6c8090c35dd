"""The Horovod-compatible face (``import bps_tf as hvd``): allreduce and the
other collectives, DistributedGradientTape, scatter/gather, barrier/join,
the build queries and SyncBatchNormalization. Public names are re-exported
by ``bps_tf``; import this package's modules only from inside bps_tf."""
