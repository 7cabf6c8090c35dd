"""The cross-worker key contract: how every push_pull and broadcast is named.

Workers never agree on tensors by negotiation: the engine matches the parts
of one tensor across workers by its name (its *key*). Every worker must
therefore give the same tensor the same name, computed locally. Every name
that reaches the ops is formed here.

How a name is formed
--------------------
* **Horovod face, eager mode** (``api.push_pull``, ``broadcast``,
  ``allgather``, ``broadcast_object``): ``<Family>/<name>`` with an explicit
  ``name=``; without one, ``<Family>/eager.<i>`` where ``i`` counts the unnamed
  eager calls of this process. Unnamed eager calls must happen in the same
  order on every worker (each one is a new key: name calls made in a loop).
* **Horovod face, inside a tf.function** (or any graph being built):
  ``<Family>/<name>``, the name defaulting to the op name of the tensor (the
  same on every worker that traces the same program). A name used twice in
  one graph gets ``_1``, ``_2`` ... in tracing order.
  Families: ``PushPull`` (every reduce op: Min, Max and Product are told
  apart by the op's ``reduce_op``, declared with the shape), ``Broadcast``,
  ``Allgather``, ``BroadcastObject``, ``Reducescatter``, ``Alltoall`` (two
  allgathers ``<key>/splits`` and ``<key>/data``), ``Barrier``,
  ``Broadcast_`` (in place: ``Broadcast_[/<name>]/<variable path>``),
  ``SyncBatchNormalization`` (``<family>/<layer path>``); grouped calls with
  an explicit name use ``<name>/<i>``;
  an ``IndexedSlices`` push_pull is two allgathers ``<name>/values`` and
  ``<name>/indices``; an allgather is two sums ``<key>/counts`` and
  ``<key>/data``; ``broadcast_object`` two broadcasts ``<key>/length`` and
  ``<key>/data``.
* **Process sets** (``process_set=``): the same names as above, except
  that unnamed eager calls are numbered per set: ``<Family>/set<k>.eager.<i>``,
  ``k`` the set's ``key_id`` (never reused, unlike its ``process_set_id``).
  The set's ranks travel in the op's agreement (``set=0,2``), so the
  servers' key (from name and signature) differs from a global call's of
  the same name, while workers that pass different sets under one name
  meet and all fail, naming both sets.
* **A variable** (``broadcast_variables``, gradients of
  ``DistributedGradientTape`` / ``DistributedOptimizer``): ``<prefix>/<path>``
  where ``path`` is the Keras 3 ``variable.path`` (else the tf name without
  ``:0``), made unique within the list by ``_1``, ``_2`` ... in list order;
  then wrapped in the family as above (``PushPull/DistributedOptimizer/...``).
  Workers must build the same variables under the same paths.
* **A TF1 graph** (``tf1_rewriter.rewrite_graph_def``):
  ``<name_prefix>/<variable node name>`` (default prefix ``rewriter``).
* **A strategy reduction** (``BytePSStrategy``): nothing depends on layer or
  variable names, which Keras numbers per process. Inside a traced function
  a key is ``bps.strategy/<graph path>/<n>``: the n-th tensor reduced while
  tracing that graph, the graph path being the function's name and those of
  enclosing functions without the process-wide counter TensorFlow appends.
  In eager mode it is ``bps.strategy/eager/<i>``, the i-th tensor of the call.
  A new variable's initial value is the broadcast ``bps.strategy/init/<i>``
  (the i-th variable created: same program, same order), model state
  ``bps.strategy/state/<i>`` (by position in :func:`model_variables`).
* **Overlapped gradients** (``bps_tf.overlap``): ``Overlap/<prefix>/<path>``,
  variable names made unique as above; one key per variable, pending from
  the end of one step to its first use in the next.
* **Asynchronous parameters** (``bps_tf.comm.async_training``): ``bps_async/<...>``
  -- the prefix is what makes a key asynchronous on the servers
  (core/protocol.h ``kAsyncNamePrefix``). Under ``BytePSStrategy`` a
  trainable variable's key is ``bps_async/strategy/<i>`` (the i-th trainable
  variable created: same program, same order); for the Horovod face
  ``bps_async/var/<path>`` (made unique within the list as above); the
  per-worker step counter is ``bps_async/steps``.
* **Gradients of the ops themselves** (``tf.GradientTape`` through a
  push_pull): ``<key>/grad``.

What must be equal on every worker
----------------------------------
The program (the same functions traced, the same variables created in the
same order under the same paths, unnamed eager calls in the same order) and
the explicit names. Shapes and dtypes under one key must match too.

When it is not
--------------
Two workers sending different tensors under one key is detected by the
engine: a size or dtype mismatch fails the op with an error naming the key.
A key that only some workers send never completes: the others wait. For a
key's first use the scheduler reports it on every worker, with the missing
ranks, after ``BYTEPS_STALL_CHECK_TIME_SECONDS`` and stops the job after
``BYTEPS_STALL_SHUTDOWN_TIME_SECONDS``; otherwise the job ends when
``BYTEPS_OP_TIMEOUT`` (or a lost peer) is reached.
"""
from __future__ import annotations

import itertools
import re
import threading
import weakref
from typing import Any, List, Optional, Sequence

import tensorflow as tf

from bps_tf.hooks import keras_shared

# Prefix of every key BytePSStrategy makes.
STRATEGY_PREFIX = "bps.strategy"
# Default prefix of the keys rewrite_graph_def inserts.
REWRITER_PREFIX = "rewriter"

_eager_counter = itertools.count()
_eager_lock = threading.Lock()
# Names already handed out in each traced graph, to make repeats unique.
_graph_names: "weakref.WeakKeyDictionary[Any, set]" = weakref.WeakKeyDictionary()
_UID_SUFFIX = re.compile(r"_\d+$")


# --------------------------------------------------------------------------
# Horovod face
# --------------------------------------------------------------------------
_set_counters: dict = {}


def next_eager_index(set_key: int = 0) -> int:
    """The next number of the per-process counter of unnamed eager calls
    (one counter per process set: only its members make those calls)."""
    with _eager_lock:
        if not set_key:
            return next(_eager_counter)
        counter = _set_counters.setdefault(set_key, itertools.count())
        return next(counter)


def unique_name(base: str, taken: set) -> str:
    """`base`, or `base_1`, `base_2`, ... : the first not in `taken` (then added)."""
    name, n = base, 0
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    taken.add(name)
    return name


def tensor_op_name(tensor) -> Optional[str]:
    """The op name behind a graph tensor (or IndexedSlices); None in eager mode."""
    if isinstance(tensor, tf.IndexedSlices):
        tensor = tensor.values
    try:
        return tensor.op.name
    except AttributeError:   # eager tensors have no op
        return None


def op_key(family: str, name: Optional[str], tensor=None, set_key: int = 0) -> str:
    """The key of one Horovod-face op: family prefix + explicit or derived name.
    Unnamed eager calls of a process set are numbered within the set."""
    if tf.executing_eagerly():
        if name is None:
            index = next_eager_index(set_key)
            name = f"set{set_key}.eager.{index}" if set_key else f"eager.{index}"
        return f"{family}/{name}"
    if name is None:
        name = tensor_op_name(tensor) or "tensor"
    graph = tf.compat.v1.get_default_graph()
    return unique_name(f"{family}/{name}", _graph_names.setdefault(graph, set()))


def sparse_base(name: Optional[str], slices, set_key: int = 0) -> str:
    """Base name of an IndexedSlices push_pull (its values and indices are
    gathered under ``<base>/values`` and ``<base>/indices``)."""
    base = name if name is not None else tensor_op_name(slices)
    if base is None:   # eager, unnamed: one counter value for both parts
        index = next_eager_index(set_key)
        base = f"set{set_key}.eager.{index}" if set_key else f"eager.{index}"
    return base


def part_key(key: str, part: str) -> str:
    """Key of one part of a composite op (``counts``, ``data``, ``length`` ...)."""
    return f"{key}/{part}"


def gradient_key(key: str) -> str:
    """Key of the push_pull that carries the gradient of op ``key``."""
    return f"{key}/grad"


# --------------------------------------------------------------------------
# Variables
# --------------------------------------------------------------------------
def variable_name(variable) -> str:
    """A variable's stable name: Keras 3 ``.path``, else ``.name`` without ':0'."""
    path = getattr(variable, "path", None)
    if isinstance(path, str) and path:
        return path
    name = getattr(variable, "name", None) or "variable"
    return name[:-2] if name.endswith(":0") else name


def unique_names(names: Sequence[str]) -> List[str]:
    """Makes a list of names unique (two unnamed tf.Variables are both
    'Variable'); suffixes depend only on list order, so workers agree."""
    seen, out = {}, []
    for name in names:
        n = seen.get(name, 0)
        seen[name] = n + 1
        out.append(name if n == 0 else f"{name}_{n}")
    return out


def source_name(source, index: int) -> str:
    """Name of a gradient's source: its variable name, else its op name."""
    if isinstance(source, (tf.Variable,)) or hasattr(source, "path"):
        return variable_name(source)
    return tensor_op_name(source) or f"source{index}"


def overlap_keys(variables: Sequence, prefix: str) -> List[str]:
    """Keys of the split push_pulls of ``variables``' gradients (bps_tf.overlap)."""
    return unique_names([f"Overlap/{prefix}/{variable_name(v)}" for v in variables])


def overlap_index_keys(count: int, prefix: str) -> List[str]:
    """Keys of the split push_pulls of a model's trainable variables under
    ``model.fit`` overlap (bps_tf.overlap.fit): by position, because Keras
    numbers variable paths per process; ``prefix`` counts the models."""
    return [f"Overlap/{prefix}/{i}" for i in range(count)]


def optimizer_variables(optimizer) -> list:
    """An optimizer's variables as a list: a Keras 3 optimizer holds a list,
    a tf_keras (Keras 2) legacy one a method; None has none."""
    found = getattr(optimizer, "variables", None) or []
    if callable(found):
        found = found()
    return list(found)


def model_variables(model, skip_on_read: bool = False) -> list:
    """A model's variables, then its optimizer's (each once), in a fixed order.

    Workers that built the same model list the same variables in the same
    order, so the position in this list is a key. ``skip_on_read`` leaves
    out SyncOnRead variables (metrics: per-replica partial values).
    """
    out, seen = [], set()
    for v in list(model.variables) + optimizer_variables(getattr(model, "optimizer", None)):
        if id(v) in seen:
            continue
        if skip_on_read and getattr(v, "synchronization", None) == "on_read":
            continue
        seen.add(id(v))
        out.append(v)
    return out


def graph_def_key(variable_node: str, name_prefix: str = REWRITER_PREFIX) -> str:
    """Key of the push_pull the TF1 rewriter puts before a variable's update."""
    return f"{name_prefix}/{variable_node}"


# --------------------------------------------------------------------------
# Strategy
# --------------------------------------------------------------------------
def strategy_key(*parts) -> str:
    """``bps.strategy/<part>/<part>...`` for fixed strategy keys."""
    return "/".join([STRATEGY_PREFIX] + [str(p) for p in parts])


def graph_path(graph) -> str:
    """A traced graph's name and those of its enclosing graphs, without the
    process-wide counter TensorFlow appends to function and branch names."""
    parts = []
    while graph is not None:
        name = getattr(graph, "name", None) or "graph"
        parts.append(_UID_SUFFIX.sub("", str(name)))
        graph = getattr(graph, "outer_graph", None)
    return "/".join(reversed(parts))


class StrategyNamer:
    """Keys of the strategy's reductions (see the module docstring)."""

    def __init__(self):
        self._counters: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def batch(self, count: int) -> List[str]:
        """Keys for the ``count`` tensors of one reduction call."""
        if tf.executing_eagerly():
            return [strategy_key("eager", i) for i in range(count)]
        graph = tf.compat.v1.get_default_graph()
        with self._lock:
            counter = self._counters.get(graph)
            if counter is None:
                counter = self._counters[graph] = itertools.count()
            numbers = [next(counter) for _ in range(count)]
        path = graph_path(graph)
        return [strategy_key(path, n) for n in numbers]


# Must equal kAsyncNamePrefix in bps_tf/core/protocol.h (tests/test_async.py).
ASYNC_PREFIX = "bps_async/"
_async_counter = itertools.count()
_async_lock = threading.Lock()


def async_key(*parts) -> str:
    """``bps_async/<part>/<part>...``: a key the servers treat as asynchronous."""
    return ASYNC_PREFIX + "/".join(str(p) for p in parts)


def next_async_variable_key() -> str:
    """Key of the next trainable variable BytePSStrategy creates in async mode."""
    with _async_lock:
        return async_key("strategy", next(_async_counter))


_init_counter = itertools.count()
_init_lock = threading.Lock()


def next_init_key() -> str:
    """Key of the broadcast of a new variable's initial value: variables
    are created in the same order on every worker (same program)."""
    with _init_lock:
        return strategy_key("init", next(_init_counter))


def allgather_data_key(key: str, eager_total_rows: Optional[int] = None) -> str:
    """Key of an allgather's data sum. Strategy eager keys are reused from
    call to call, so there the total row count joins the key (one key per size)."""
    data = part_key(key, "data")
    return data if eager_total_rows is None else f"{data}.rows{eager_total_rows}"


# --------------------------------------------------------------------------
# Names for people (never keys)
# --------------------------------------------------------------------------
def variable_identity(path: str) -> str:
    """What workers must agree a variable is, from its Keras path: each
    component without the number Keras appends per process (``dense_3`` is
    ``dense``), so the same model built after other models still agrees,
    while a layer of another type or a user-named layer in another place
    does not. No spaces (it travels in an agreement text)."""
    parts = [re.sub(r"_\d+$", "", part) for part in str(path or "").split("/")]
    return "/".join(p for p in parts if p).replace(" ", "_") or "variable"


def display_path(name) -> str:
    """The path a person knows a variable being created now by (Keras 3's
    ``model/layer/kernel``), for error messages and the timeline only: it is
    this process's own business, so it never enters a key."""
    path = keras_shared.creating_path()
    return str(path) if path else str(name or "").split(":")[0]
