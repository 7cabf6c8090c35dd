"""``bps_tf.init()``: join the cluster, register the process sets, and make
Keras 3 optimizers answer Horovod's ``optimizer.variables()``.

No TensorFlow here: ``import bps_tf`` stays light.
"""
from __future__ import annotations

import sys

from bps_tf.comm import optimizer_variables
from bps_tf.runtime import basics, process_sets


def init(environ=None, process_sets=None, lazy=True) -> None:  # pylint: disable=redefined-outer-name
    """Joins the cluster described by DMLC_*/TF_CONFIG (or none: size 1).
    ``lazy`` (BytePS's) is accepted: the cluster is always joined here.

    Blocks until every worker and server has met; raises with the reason if
    they disagree or do not all arrive in BYTEPS_RENDEZVOUS_TIMEOUT seconds.
    ``process_sets``: Horovod's list of ProcessSet (or rank lists) to
    register now (bps_tf.runtime.process_sets.add_process_set, on every worker alike).
    """
    del lazy
    if basics.is_initialized():
        return
    basics.join(environ)
    _register(process_sets)
    if "keras" in sys.modules:     # a script that uses Keras 3 optimizers
        optimizer_variables.install()


def _register(sets) -> None:
    process_sets.register_at_init(sets)
