"""tf.distribute's per-step end-of-data sum, without holding up the step.

Under a multi-worker strategy, the iterator of a distributed dataset sums
over every worker, before each step, how many replicas still have a batch:
a worker that ran out feeds an empty batch while the others finish, and the
data ends when none has one. The step's body, forward pass included, used to
wait for that sum; under cross-step overlap it queued behind the previous
step's gradients on the links and at the servers, 35-52 ms of a 0.19 s step
(docs/performance-history.md, "What holds an overlapped step above
max(compute, communication): the input's cross-worker check").

Yet a worker that has a batch of its own needs no answer: the sum is at least
its own count, so the step runs on its batch whatever the others say. Only a
worker without a batch must know whether another still has one. So each step
*starts* the sum (push_pull_start, which returns at once), a worker with a
batch goes on, and a worker without one waits for the sum inside the branch
that needs it. The started sum is taken out of the table by the next call of
the same site (or by that branch), long after it finished. The choice made is
the same as tf.distribute's in every case: the per-step sum still happens,
and every worker contributes to it; only who waits for it changes.

Each call site of a traced function has its own key; a site of an eager loop
shares one. ``BYTEPS_EARLY_DATA_CHECK=0`` restores the blocking sum; every
worker must choose the same (BytePSStrategy checks that when it starts).
"""
from __future__ import annotations

import atexit
import logging
import threading

import tensorflow as tf

from bps_tf.comm import collectives, naming
from bps_tf.hooks import registry as hooks
from bps_tf.runtime import basics

log = logging.getLogger("bps_tf")
_lock = threading.Lock()
GROUP = "data"
_drain_registered = [False]
_PREFIX = naming.strategy_key("data_check") + "/"


def _key() -> str:
    if tf.executing_eagerly():
        return _PREFIX + "eager"
    graph = tf.compat.v1.get_default_graph()
    return naming.op_key(_PREFIX + naming.graph_path(graph), "replicas_with_values")


def replicas_with_values(local):
    """The count of replicas that have a batch, as the step must see it:
    ``local`` (this worker's count, int64 [1]) when it is above 0, else the
    sum over every worker. The sum is started on every call."""
    key = _key()
    previous, _ = collectives.push_pull_wait(local, key)   # the last call's sum, if pending
    # Like the start: the forward pass must not wait behind it in program order.
    collectives.run_independently(previous)
    with tf.control_dependencies([previous]):
        token = collectives.push_pull_start(local, key, collectives.BLOCKING_PRIORITY)

    def everyone():
        with tf.control_dependencies([token]):
            summed, valid = collectives.push_pull_wait(local, key)
        with tf.control_dependencies([tf.debugging.Assert(
                valid, [f"bps_tf: the end-of-data sum under {key} was not pending"])]):
            return tf.identity(summed)

    return tf.cond(local[0] > 0, lambda: local, everyone)


_INPUT_LIB = "tensorflow.python.distribute.input_lib"


@hooks.register("tf input_lib._calculate_replicas_with_values", GROUP,
                hooks.module_attribute(_INPUT_LIB, "_calculate_replicas_with_values"),
                changes="the per-step end-of-data sum is waited for only by a worker without "
                        "a batch of its own",
                why="tf.distribute's input pipeline makes every step wait for the sum; no "
                    "option changes that", when_missing="fallback", private=True)
def _replicas_with_values(original):
    def calculate(strategy, input_workers, optional_list):
        if not getattr(strategy.extended, "bps_early_data_check", False):
            return original(strategy, input_workers, optional_list)
        counts = []
        for worker, optionals in zip(input_workers.worker_devices, optional_list):
            with tf.device(worker):
                counts += [tf.cast(o.has_value(), tf.int64) for o in optionals]
        local = tf.reshape(tf.add_n(counts), [1])
        return tf.reshape(replicas_with_values(local), [])
    return calculate


@hooks.register("tf input_lib._enable_get_next_as_optional", GROUP,
                hooks.module_attribute(_INPUT_LIB, "_enable_get_next_as_optional"),
                changes="every traced step checks for the end of the data, whatever dataset "
                        "it was traced for",
                why="Keras reuses a train function traced for an infinite dataset (no check) "
                    "on a finite one, which one worker could then end alone",
                when_missing="fallback", private=True)
def _enable_optional(original):
    def enable(strategy, dataset, cardinality):
        if hasattr(strategy.extended, "bps_early_data_check") and \
                strategy.extended._in_multi_worker_mode():  # pylint: disable=protected-access
            return True
        return original(strategy, dataset, cardinality)
    return enable


def drain() -> None:
    """Takes the sums still pending (at the process's exit). When every
    worker made the same get_next calls, each of them completes (a worker
    leaving before its own part went out would leave the others' sum
    unfinished at the servers). One that cannot complete is a get_next made
    by this worker only: the blocking sum failed that call; here nobody
    waited for it, so it is reported now rather than lost."""
    if not basics.is_initialized():
        return
    for key in collectives.pending_push_pulls():
        if key.startswith(_PREFIX):
            try:
                collectives.push_pull_wait(tf.zeros([1], tf.int64), key)
            except Exception as exc:  # pylint: disable=broad-except
                log.error("bps_tf: the end-of-data sum of this worker's last get_next (%s) "
                          "was not matched by every worker: this worker called next() on a "
                          "distributed iterator more often than another (%s)",
                          key, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def install() -> bool:
    """Installs the two input-pipeline hooks (once per process). False
    when this TensorFlow moved one of them (one warning): every step then
    waits for TensorFlow's own blocking sum, exact and slower."""
    gone = hooks.install(GROUP)
    with _lock:
        if not _drain_registered[0]:
            atexit.register(drain)   # before basics' shutdown (registered earlier)
            _drain_registered[0] = True
    if gone:
        hooks.warn_fallback(GROUP, "every step waits for TensorFlow's own end-of-data sum; a "
                                   "train function traced for an infinite dataset and reused "
                                   "for a finite one may let one worker end an epoch first "
                                   "(the others then fail with a stall error)")
    return not gone
