"""Push_pull priorities from a graph's topological order.

Why topological order: after a step, the next forward pass reads the first
layer's weights first, so the first layer's gradient is needed first. The
position of each variable's *first read* in a topological order of the graph
is that order, whatever order the variables were declared in (a model may
create its layers in any order and call them in another).

Priorities: variables sorted by (position of first read, name) get
priorities 0, -1, -2, ...: the earliest-read variable is the highest (the
engine sends higher priorities first). A variable with no read comes last,
its tie broken by name.

Two users: ``BytePSStrategy`` (``cross_device_ops``) traces the Keras train
step as usual, then sets the ``priority`` attribute of each gradient's
push_pull op from :func:`variable_position` on the traced ``FuncGraph``;
``tf1_rewriter`` ranks the variables of a GraphDef with
:func:`topological_order`, :func:`first_reads` and :func:`rank_priorities`.
Nothing here talks to the cluster.
"""
from __future__ import annotations

import heapq
import weakref
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from bps_tf import config, naming

# Consumers of a variable handle that do not read the variable's value.
_NOT_READS = ("Assign", "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
              "VarIsInitializedOp", "IsVariableInitialized", "DestroyResourceOp",
              "VariableShape", "NoOp")
_NOT_READ_PREFIXES = ("Apply", "ResourceApply", "SparseApply", "ResourceSparseApply",
                      "ResourceScatter", "ScatterAdd", "ScatterSub", "ScatterUpdate")

# Ops that only forward a variable's value: their consumers are the real use.
_PASS_THROUGH = ("ReadVariableOp", "Identity", "RefIdentity", "Snapshot", "IdentityN")


def _is_read(op_type: str) -> bool:
    return op_type not in _NOT_READS and not op_type.startswith(_NOT_READ_PREFIXES)


# --------------------------------------------------------------------------
# Topological order
# --------------------------------------------------------------------------
def topological_order(nodes: Sequence[Tuple[str, Sequence[str]]],
                      back_edge_types: Mapping[str, str] = None) -> Dict[str, int]:
    """Position of each node in a topological order.

    ``nodes`` is ``[(name, [input names])]`` in the graph's own order; among
    nodes that are ready at the same time the earlier one in that order goes
    first, so a list that is already topological keeps its order. Inputs
    from outside the list are ignored. ``back_edge_types`` maps node names to
    op types so that loop back edges (from ``NextIteration``) can be dropped;
    whatever still sits on a cycle is appended in the list's order.
    """
    index = {name: i for i, (name, _) in enumerate(nodes)}
    types = back_edge_types or {}
    pending = [0] * len(nodes)
    users: List[List[int]] = [[] for _ in nodes]
    for i, (_, inputs) in enumerate(nodes):
        for src in set(inputs):
            j = index.get(src)
            if j is None or j == i or types.get(src) == "NextIteration":
                continue
            pending[i] += 1
            users[j].append(i)
    ready = [i for i, n in enumerate(pending) if n == 0]
    heapq.heapify(ready)
    order: Dict[str, int] = {}
    while ready:
        i = heapq.heappop(ready)
        order[nodes[i][0]] = len(order)
        for k in users[i]:
            pending[k] -= 1
            if pending[k] == 0:
                heapq.heappush(ready, k)
    for name, _ in nodes:   # cycles left: keep the list's order
        if name not in order:
            order[name] = len(order)
    return order


def first_reads(order: Mapping[str, int], consumers: Mapping[str, List[Tuple[str, str]]],
                 handles: Iterable[str]) -> Dict[str, int]:
    """Topological position of the first *use* of each handle's value
    (handles never read are absent).

    A read op (ReadVariableOp, a ref variable's Identity) depends only on
    the handle, so its own position floats: TF1 even creates one per
    variable when the variable is made. What matters is where the value is
    first consumed, so reads and identities are looked through to their
    consumers; a read nobody consumes does not count.
    """
    memo: Dict[str, Optional[int]] = {}

    def first_use(name: str, depth: int = 0) -> Optional[int]:
        if name in memo:
            return memo[name]
        memo[name] = None   # cycles (loops) end here
        uses = []
        for user, op_type in consumers.get(name, ()):
            if op_type in _PASS_THROUGH and depth < 32:
                position = first_use(user, depth + 1)
            else:
                position = order.get(user)
            if position is not None:
                uses.append(position)
        memo[name] = min(uses) if uses else None
        return memo[name]

    positions = {}
    for handle in handles:
        uses = []
        for user, op_type in consumers.get(handle, ()):
            if not _is_read(op_type):
                continue
            position = first_use(user) if op_type in _PASS_THROUGH else order.get(user)
            if position is not None:
                uses.append(position)
        if uses:
            positions[handle] = min(uses)
    return positions


def rank_priorities(keys: Sequence[str], positions: Mapping[str, int]) -> Dict[str, int]:
    """0, -1, -2, ... in order of first read; unread keys last; ties by key."""
    unread = float("inf")
    ordered = sorted(keys, key=lambda k: (positions.get(k, unread), k))
    return {k: -i for i, k in enumerate(ordered)}


# --------------------------------------------------------------------------
# FuncGraph (TF2: tf.function / Keras train step)
# --------------------------------------------------------------------------
_graph_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def graph_read_positions(graph) -> Dict[str, int]:
    """For every resource handle node in ``graph`` (variables created in it,
    or the placeholders of captured ones): the topological position of its
    first read. Computed once per graph, when first asked (for a train
    step: after the forward and backward pass have been traced)."""
    cached = _graph_cache.get(graph)
    if cached is not None:
        return cached
    ops = graph.get_operations()
    nodes, consumers = [], {}
    handles = set()
    for op in ops:
        inputs = [t.op.name for t in op.inputs] + [c.name for c in op.control_inputs]
        nodes.append((op.name, inputs))
        for t in op.inputs:
            consumers.setdefault(t.op.name, []).append((op.name, op.type))
            if t.dtype == tf.resource:
                handles.add(t.op.name)
    order = topological_order(nodes, {op.name: op.type for op in ops})
    positions = first_reads(order, consumers, handles)
    _graph_cache[graph] = positions
    return positions


_capture_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _internal_capture(graph, tensor):
    """The placeholder standing for the outer ``tensor`` in ``graph``, if
    captured. The map is rebuilt when the graph captured more since."""
    captures = list(getattr(graph, "captures", ()))
    cached = _capture_cache.get(graph)
    if cached is None or cached[0] != len(captures):
        cached = (len(captures), {id(ext): internal for ext, internal in captures})
        _capture_cache[graph] = cached
    return cached[1].get(id(tensor))


def _tensor_in_graph(graph, tensor):
    """``tensor`` as seen from inside ``graph``: itself, its capture, or the
    capture of its capture in the enclosing function (nested functions such
    as a Keras step inside a while loop capture through their parents)."""
    if graph is None:
        return None
    if getattr(tensor, "graph", None) is graph:
        return tensor
    internal = _internal_capture(graph, tensor)
    if internal is not None:
        return internal
    outer = _tensor_in_graph(getattr(graph, "outer_graph", None), tensor)
    return _internal_capture(graph, outer) if outer is not None else None


def handle_in_graph(graph, variable) -> Optional[str]:
    """Name of the node that stands for ``variable``'s handle inside
    ``graph``: the variable's own handle op, or the placeholder of the
    captured handle. ``None`` if the graph does not use the variable."""
    handle = getattr(variable, "handle", None)
    if handle is None:
        return None
    internal = _tensor_in_graph(graph, handle)
    return internal.op.name if internal is not None else None


def variable_position(graph, variable) -> Optional[int]:
    """Topological position of ``variable``'s first read in ``graph``."""
    node = handle_in_graph(graph, variable)
    return graph_read_positions(graph).get(node) if node is not None else None


def variable_priorities(graph, variables: Sequence) -> List[int]:
    """Priority of each variable (same order as ``variables``) from the
    first reads in ``graph``: 0 for the first read, then -1, -2, ...
    Ties (unread variables) are broken by name (Keras path or tf name)."""
    keys = [f"{naming.variable_name(var)}#{i}" for i, var in enumerate(variables)]
    positions = {}
    for key, var in zip(keys, variables):
        position = variable_position(graph, var)
        if position is not None:
            positions[key] = position
    ranks = rank_priorities(keys, positions)
    return [ranks[k] for k in keys]


def set_priority(op, priority: int) -> None:
    """Sets the ``priority`` attr of a push_pull op already in a graph.

    With BYTEPS_PRIORITY_SCHEDULING=0 gradients keep one priority, so the
    engine sends them in the order they are enqueued (FIFO), for comparison.
    """
    if not config.value("BYTEPS_PRIORITY_SCHEDULING"):
        return
    op._set_attr("priority", attr_value_pb2.AttrValue(i=int(priority)))  # pylint: disable=protected-access
