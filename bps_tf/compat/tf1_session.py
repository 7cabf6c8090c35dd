"""TF1 graphs and sessions: every global variable from the root, as an op
or as a ``SessionRunHook`` (Horovod's and BytePS's
``broadcast_global_variables`` / ``BroadcastGlobalVariablesHook``).

    hooks = [bps_tf.BroadcastGlobalVariablesHook(0)]
    with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess: ...

Eager code has no global variable collection: there the error names
``bps_tf.broadcast_variables`` instead.
"""
from __future__ import annotations

import tensorflow as tf

from bps_tf.comm import exchange

__all__ = ["broadcast_global_variables", "BroadcastGlobalVariablesHook"]


def broadcast_global_variables(root_rank):
    """An op that assigns ``root_rank``'s value to every global variable of
    the default graph (run it once, after the variables are initialized)."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "broadcast_global_variables() needs a TF1 graph (eager code has no global "
            "variables): use bps_tf.broadcast_variables(model.variables, root_rank) or, "
            "with Keras, bps_tf.keras.callbacks.BroadcastGlobalVariablesCallback(root_rank).")
    return exchange.broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Broadcasts every global variable from ``root_rank`` when the session
    is created (and again after a restore re-creates it), so every worker
    starts from the same weights. ``device`` places the broadcast ops."""

    def __init__(self, root_rank, device=""):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op = None

    def begin(self):
        # A hook may be reused with a new graph (Estimator builds one per
        # call): build the op again in the graph that is about to run.
        if self.bcast_op is None or self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)
