"""Asynchronous parameter-server training: the servers hold the parameters.

Each worker trains on its own: its optimizer applies its own gradients to
its own copy of the weights, then it *pushes the change* (new - old) of every
trainable variable and *pulls* the servers' current value, which replaces
its copy. The servers add every push to the value they hold and answer it at
once (keys named ``bps_async/...``, see bps_tf/core/protocol.h), so no worker
waits for another during a step.

* :func:`start_from_root` -- the one synchronisation: every worker arrives,
  the root rank writes its weights into the servers' store (unless the store
  already holds what the root last pulled: a second ``fit`` keeps the
  others' updates), every worker arrives again, then pulls.
* :func:`exchanging` -- wraps one variable's optimizer update (in the graph
  of the train step) so that the update is followed by push delta / pull.
* :func:`pull` -- the servers' current value into local variables.
* :func:`stats` -- steps, pushes per worker and staleness (how many updates
  of other workers were folded into the store between two pulls of this
  worker), from a per-step counter ``bps_async/steps``; logged every
  ``BYTEPS_ASYNC_LOG_STEPS`` steps at INFO.

Optimizer state (Adam's moments, the iteration count) and non-trainable
variables (BatchNormalization's moving statistics) stay local to each worker.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading

import numpy as np
import tensorflow as tf

from bps_tf.comm import collectives, naming
from bps_tf.runtime import basics, config

__all__ = ["enabled", "key_of", "keys_of", "start_from_root", "pull", "pull_parameters",
           "exchange_all", "exchanging", "count", "stats", "refuse_gradient_exchange",
           "check_started"]

log = logging.getLogger("bps_tf")

STEPS_KEY = naming.async_key("steps")
# Pushes of parameters block nothing in this step (the pulled value replaces
# the variable at its end), so they keep the gradients' default range.
PARAMETER_PRIORITY = 0

_lock = threading.Lock()
_started = set()      # keys this process has pulled since the store was seeded
_last_pulled = {}     # key -> the value this process last pulled (numpy)
_start_counter = itertools.count()
_stats = {"steps": 0, "pushes": [], "staleness_last": 0, "staleness_max": 0,
          "staleness_sum": 0, "others_seen": None}


def enabled() -> bool:
    """BYTEPS_ENABLE_ASYNC=1 (BytePS's own switch)."""
    return bool(config.value("BYTEPS_ENABLE_ASYNC"))


def refuse_gradient_exchange(where: str) -> None:
    """Raises in async mode for a path that can only average gradients."""
    if enabled():
        raise NotImplementedError(
            f"{where}: asynchronous training (BYTEPS_ENABLE_ASYNC=1) exchanges weights, not "
            "gradients, and this path never sees the optimizer's step. Use "
            "bps_tf.keras.DistributedOptimizer(keras optimizer) (it applies locally, pushes "
            "the weight change and pulls the weights) or BytePSStrategy(mode='async'); or "
            "unset BYTEPS_ENABLE_ASYNC for synchronous training.")


def _tf_variable(variable):
    """The TensorFlow variable behind a Keras 3 variable (or itself)."""
    if isinstance(variable, tf.Variable):
        return variable
    inner = getattr(variable, "value", None)
    return inner if isinstance(inner, tf.Variable) else variable


def key_of(variable, fallback: str = None) -> str:
    """The store key of a variable: the one BytePSStrategy gave it at
    creation, else ``fallback`` (the Horovod face passes a path-based one)."""
    key = getattr(_tf_variable(variable), "bps_async_key", None)
    if key is None:
        key = fallback or naming.async_key("var", naming.variable_name(variable))
    return key


def keys_of(variables) -> list:
    fallbacks = naming.unique_names([naming.async_key("var", naming.variable_name(v))
                                     for v in variables])
    return [key_of(v, f) for v, f in zip(variables, fallbacks)]


def _alone() -> bool:
    # One worker: its weights are the parameters (and without servers a
    # push_pull returns its input, which here would be the change alone).
    return basics.size() == 1


def _exchange(value, key: str):
    """Pushes ``value`` into the store under ``key``; returns the store after it."""
    return collectives.push_pull_sum(value, key, PARAMETER_PRIORITY)


def _barrier(tag: str) -> None:
    arrived = collectives.push_pull_sum(tf.ones([1], tf.int32),
                                        naming.strategy_key("async", tag),
                                        collectives.BLOCKING_PRIORITY)
    if int(arrived.numpy()[0]) != basics.size():
        raise RuntimeError(f"asynchronous training: {int(arrived.numpy()[0])} of "
                           f"{basics.size()} workers reached the start")


def _check_dtypes(variables, keys) -> None:
    for v, k in zip(variables, keys):
        if tf.as_dtype(v.dtype) not in collectives.SUPPORTED_DTYPES:
            raise TypeError(f"asynchronous training cannot keep {naming.variable_name(v)} "
                            f"({tf.as_dtype(v.dtype).name}, key {k}) on the servers; "
                            "supported: float16, bfloat16, float32, float64, int32, int64.")


def _catalogue(variables, keys) -> list:
    return [f"{k} {naming.variable_identity(naming.variable_name(v))} "
            f"{tf.as_dtype(v.dtype).name}{list(v.shape)}" for v, k in zip(variables, keys)]


def _check_catalogue(variables, keys, tag: str) -> None:
    """Every worker keeps the same variables under the same keys: the
    servers answer an asynchronous worker without waiting for the others,
    so nothing else would notice a variable missing on one worker, or two
    swapped. One exchange of each worker's whole list, compared by all."""
    # One int32 per byte: the sum that carries the allgather takes no uint8,
    # and the lists are small.
    mine = np.frombuffer("\n".join(_catalogue(variables, keys)).encode(), np.uint8).astype(np.int32)
    rows, _ = collectives.allgather(tf.constant(mine), naming.strategy_key("async", tag + "/list"),
                                    basics.rank(), basics.size())
    counts = collectives.push_pull_sum(
        tf.scatter_nd([[basics.rank()]], tf.constant([mine.size], tf.int64), [basics.size()]),
        naming.strategy_key("async", tag + "/sizes"), collectives.BLOCKING_PRIORITY).numpy()
    data, start, lists = rows.numpy().astype(np.uint8).tobytes(), 0, []
    for count in counts:
        lists.append(data[start:start + int(count)].decode().split("\n"))
        start += int(count)
    if all(found == lists[0] for found in lists):
        return
    other = next(r for r, found in enumerate(lists) if found != lists[0])
    first, second = lists[0], lists[other]
    where = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b),
                 min(len(first), len(second)))
    shown = lambda found: found[where] if where < len(found) else "(nothing)"  # noqa: E731
    raise RuntimeError(
        f"asynchronous training: the workers keep different variables on the servers: rank 0 "
        f"has {len(first)} ({shown(first)!r} at position {where}), rank {other} has "
        f"{len(second)} ({shown(second)!r}). Every worker must build the same model, with the "
        f"same variables in the same order.")


def start_from_root(variables, root_rank: int = 0) -> None:
    """Every worker calls this (eagerly, at the same point): afterwards the
    store holds the root's values of ``variables`` and every worker holds
    the store's. Variables already in the store, whose value on the root is
    what the root last pulled, keep the store's value."""
    if not tf.executing_eagerly():
        raise RuntimeError("asynchronous training starts outside tf.function "
                           "(fit does it at train begin).")
    variables = list(variables)
    if not variables or _alone():
        return
    keys = keys_of(variables)
    _check_dtypes(variables, keys)
    n = next(_start_counter)
    _barrier(f"start{n}/arrive")
    _check_catalogue(variables, keys, f"start{n}")
    if basics.rank() == root_rank:
        for v, k in zip(variables, keys):
            local = np.asarray(tf.convert_to_tensor(v))
            last = _last_pulled.get(k)
            if last is not None and last.shape == local.shape and np.array_equal(last, local):
                continue   # unchanged since the root's last pull: keep the store
            stored = _exchange(tf.zeros_like(tf.convert_to_tensor(v)), k)
            _exchange(tf.convert_to_tensor(v) - stored, k)
    _barrier(f"start{n}/seeded")
    pull(variables)


def pull(variables) -> None:
    """Assigns the store's current values to ``variables`` (eagerly)."""
    variables = list(variables)
    if _alone():
        return
    keys = keys_of(variables)
    for v, k in zip(variables, keys):
        value = _exchange(tf.zeros_like(tf.convert_to_tensor(v)), k)
        v.assign(value)
        with _lock:
            _last_pulled[k] = np.asarray(value)
            _started.add(k)


def pull_parameters(model) -> None:
    """The servers' latest parameters into ``model``'s trainable variables
    (e.g. after every worker's ``fit`` has ended, before saving)."""
    pull(model.trainable_variables)


# Not thread-local: MirroredStrategy runs a replica's step in its own thread
# and the optimizer's merge_call (where the updates happen) in the caller's.
_step_depth = [0]


@contextlib.contextmanager
def optimizer_step():
    """Marks the (traced) optimizer ``apply``: the strategy exchanges the
    updates made inside it and only those (a ``set_weights`` or a pull is an
    assignment, not a step)."""
    with _lock:
        _step_depth[0] += 1
    try:
        yield
    finally:
        with _lock:
            _step_depth[0] -= 1


def in_optimizer_step() -> bool:
    return _step_depth[0] > 0


def check_started(key: str, variable) -> None:
    """At trace time: a variable whose store was never seeded would pull
    zeros plus deltas -- refuse instead."""
    if _alone():
        return
    with _lock:
        ok = key in _started
    if not ok:
        raise RuntimeError(
            f"asynchronous training: the servers hold no value for "
            f"{naming.variable_name(variable)} (key {key}) yet. Start from rank 0's "
            "weights first: model.fit does it under BytePSStrategy(mode='async'); with "
            "DistributedOptimizer use bps_tf.keras.callbacks.BroadcastGlobalVariablesCallback(0) "
            "or bps_tf.broadcast_variables(model.variables, root_rank=0); in a custom loop "
            "under the strategy call bps_tf.comm.async_training.start_from_root(variables).")


def exchange_after(variable, key: str, update):
    """In a traced step: ``update()`` (the optimizer's assignments to
    ``variable``), then push the change and assign the pulled value."""
    before = tf.identity(tf.convert_to_tensor(variable))
    with tf.control_dependencies([before]):
        out = update()
    deps = [t for t in tf.nest.flatten(out) if isinstance(t, (tf.Tensor, tf.Operation))]
    with tf.control_dependencies(deps):
        after = tf.identity(tf.convert_to_tensor(variable))
    pulled = _exchange(after - before, key)
    return variable.assign(pulled)


def exchange_all(variables, update):
    """``update()`` (a whole optimizer step over ``variables``), then push
    every variable's change, assign the pulled values and count the step."""
    variables = list(variables)
    if _alone():
        return update()
    keys = keys_of(variables)
    for k, v in zip(keys, variables):
        check_started(k, v)
    befores = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
    with tf.control_dependencies(befores):
        out = update()
    deps = [t for t in tf.nest.flatten(out) if isinstance(t, (tf.Tensor, tf.Operation))]
    with tf.control_dependencies(deps):
        afters = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
    for v, k, before, after in zip(variables, keys, befores, afters):
        v.assign(_exchange(after - before, k))
    count()
    return out


def exchanging(fn, key: str, variable, count_step: bool):
    """``fn(v, *args)`` (a strategy update of one local copy ``v``) followed by
    the exchange of ``v``; ``count_step`` also pushes the step counter."""
    check_started(key, variable)
    if _alone():
        return fn

    def wrapped(v, *args, **kwargs):
        result = exchange_after(v, key, lambda: fn(v, *args, **kwargs))
        if count_step:
            count()
        return result
    return wrapped


def count():
    """Pushes this worker's step into ``bps_async/steps`` and notes staleness."""
    size, rank = basics.size(), basics.rank()
    pushes = _exchange(tf.scatter_nd([[rank]], tf.ones([1], tf.int64), [size]), STEPS_KEY)
    return tf.py_function(_observe, [pushes], [])


def _observe(pushes) -> None:
    counts = pushes.numpy().tolist()
    others = sum(counts) - counts[basics.rank()]
    every = int(config.value("BYTEPS_ASYNC_LOG_STEPS"))
    with _lock:
        seen = _stats["others_seen"]
        staleness = 0 if seen is None else max(0, others - seen)
        _stats["others_seen"] = others
        _stats["steps"] += 1
        _stats["pushes"] = counts
        _stats["staleness_last"] = staleness
        _stats["staleness_max"] = max(_stats["staleness_max"], staleness)
        _stats["staleness_sum"] += staleness
        steps = _stats["steps"]
        mean = _stats["staleness_sum"] / steps
    if every > 0 and steps % every == 0:
        log.info("async step %d: staleness %d (mean %.2f, max %d); steps per worker %s",
                 steps, staleness, mean, _stats["staleness_max"], counts)


def stats() -> dict:
    """This process's asynchronous steps: ``steps``, ``pushes`` (steps per
    worker as the store counted them at this worker's last step),
    ``staleness_last``/``staleness_max``/``staleness_mean``."""
    with _lock:
        out = {k: v for k, v in _stats.items() if k not in ("others_seen", "staleness_sum")}
        out["pushes"] = list(_stats["pushes"])
        out["staleness_mean"] = (_stats["staleness_sum"] / _stats["steps"]
                                 if _stats["steps"] else 0.0)
    return out
