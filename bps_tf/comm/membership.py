"""This worker's rank and the job's size, for code that builds collectives.

Eagerly they are plain ints. Inside a graph being built (``tf.function``, a
TF1 graph) they are int32 scalars read by an op *when the graph runs*
(``BytepsMembership``): an elastic job's workers change while its traced
graphs live on, and a graph that averages by the size, or places this
worker's rows by its rank, must see the membership it runs in, not the one
it was traced in. That is how a Horovod script's ``@tf.function`` step,
traced once, stays right after workers leave or join (Horovod reads them at
run time too). A process set's ranks are fixed lists: its collectives carry
the membership epoch instead, and a graph of an old epoch is refused.
"""
from __future__ import annotations

from typing import Tuple

import tensorflow as tf

from bps_tf.runtime import basics


def _query(what: str):
    if tf.executing_eagerly():
        return int(getattr(basics, what)())
    from bps_tf.comm import collectives   # the op library: loaded on first use
    return collectives.membership_op(what)


def rank():
    """This worker's rank: an int eagerly, an int32 scalar read at run time in a graph."""
    return _query("rank")


def size():
    """The number of workers: an int eagerly, an int32 scalar read at run time in a graph."""
    return _query("size")


def local_rank():
    return _query("local_rank")


def local_size():
    return _query("local_size")


def in_set(process_set) -> Tuple:
    """(this worker's rank within ``process_set``, its size): the global
    set's read when the graph runs, another set's fixed (its ranks are)."""
    if process_set is None or process_set.ranks is None:
        return rank(), size()
    return process_set.rank(), process_set.size()


def set_size(process_set):
    """The number of workers of ``process_set`` (see :func:`in_set`)."""
    if process_set is None or process_set.ranks is None:
        return size()
    return process_set.size()
