"""Push_pull insertion into TF1 GraphDefs.

:func:`rewrite_graph_def` takes a ``tf.compat.v1`` GraphDef and inserts a
``BytepsPushPull`` node between every dense gradient and the optimizer op
that applies it, named ``naming.graph_def_key``. Priorities are not computed
here: the C++ priority pass in the op library (bps_tf/ops/priority_pass.cc)
ranks those nodes by their variables' first reads when a session runs the
graph. For a whole TF1 training script, ``bps_tf.compat.v1.enable_graph_rewrite()``
makes that pass insert the push_pulls itself (dense and sparse updates).
Nothing here talks to the cluster; ``rewrite_graph_def`` only needs the
number of workers for averaging.
"""
from __future__ import annotations

import logging
from typing import List, Mapping, Optional

import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2

from bps_tf.comm import naming
from bps_tf.hooks import tf_internals
from bps_tf.runtime import basics

log = logging.getLogger("bps_tf.compat.tf1_rewriter")

PUSH_PULL_OP = "BytepsPushPull"

# Ops that create a variable (ref or resource) in a GraphDef.
_VARIABLE_OPS = ("VarHandleOp", "VariableV2", "Variable")

# Dense optimizer ops: their gradient input is named "grad" (or "delta").
_GRAD_ARG_NAMES = ("grad", "delta")


# --------------------------------------------------------------------------
# GraphDef (TF1 graph mode)
# --------------------------------------------------------------------------
def _input_node(name: str) -> str:
    """'^a' -> 'a', 'a:1' -> 'a'."""
    return name.lstrip("^").split(":")[0]


def _grad_input_index(op_type: str) -> Optional[int]:
    """Index of the dense gradient input of an optimizer op, or None."""
    if not op_type.startswith(("Apply", "ResourceApply")):
        return None
    op_def = tf_internals.OP_DEF_REGISTRY.get(op_type)
    if op_def is None:
        return None
    names = [arg.name for arg in op_def.input_arg]
    if any(arg.number_attr or arg.type_list_attr for arg in op_def.input_arg):
        return None
    for wanted in _GRAD_ARG_NAMES:
        if wanted in names:
            return names.index(wanted)
    return None


def _variable_of(graph_def_nodes: Mapping[str, node_def_pb2.NodeDef], name: str,
                 types: Mapping[str, str]) -> Optional[str]:
    """Follows Identity/ReadVariableOp-free handle chains to the variable node."""
    seen = 0
    while name in graph_def_nodes and types.get(name) not in _VARIABLE_OPS and seen < 16:
        node = graph_def_nodes[name]
        if node.op not in ("Identity", "RefIdentity") or not node.input:
            return None
        name = _input_node(node.input[0])
        seen += 1
    return name if types.get(name) in _VARIABLE_OPS else None


def rewrite_graph_def(graph_def, num_workers: Optional[int] = None,
                      average: bool = True, name_prefix: str = naming.REWRITER_PREFIX):
    """A copy of ``graph_def`` with a ``BytepsPushPull`` node between each
    dense gradient and the optimizer op applying it (``ApplyGradientDescent``,
    ``ResourceApplyAdam``, ``ApplyMomentum``, ...: every ``Apply*`` /
    ``ResourceApply*`` op whose gradient input is named ``grad`` or ``delta``).

    * ``tensor_name`` is ``<name_prefix>/<variable node name>``: identical on
      every worker that builds the same graph.
    * ``priority`` is left at 0: the C++ priority pass ranks the push_pulls
      by their variables' first reads when a session runs the graph.
    * With ``average`` and more than one worker, the sum is multiplied by
      ``1/num_workers`` (a ``Mul`` node after the push_pull).
      ``num_workers`` defaults to ``bps_tf.size()`` (1 if not initialized).

    Sparse optimizer ops (``*SparseApply*``) are left alone: their gradient
    is a (values, indices) pair; use ``sparse_as_dense`` or the strategy.
    A graph that already has push_pull nodes before an apply op is not
    rewritten twice.
    """
    if num_workers is None:
        num_workers = basics.size() if basics.is_initialized() else 1
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    nodes = {n.name: n for n in out.node}
    types = {n.name: n.op for n in out.node}
    taken = set(nodes)

    # (apply node, grad input index, variable node) for every dense apply op
    targets = []
    for node in out.node:
        index = _grad_input_index(node.op)
        if index is None:
            if "SparseApply" in node.op:
                log.warning("rewrite_graph_def: %s (%s) has a sparse gradient; left as is",
                            node.name, node.op)
            continue
        if index >= len(node.input) or node.input[index].startswith("^"):
            continue
        if types.get(_input_node(node.input[index])) == PUSH_PULL_OP:
            continue   # already rewritten
        var = _variable_of(nodes, _input_node(node.input[0]), types) or _input_node(node.input[0])
        targets.append((node, index, var))

    new_nodes = []
    for apply_node, index, var in targets:
        grad = apply_node.input[index]
        dtype = apply_node.attr["T"].type
        pp = node_def_pb2.NodeDef(
            name=naming.unique_name(f"{_input_node(grad)}/BytepsPushPull", taken),
            op=PUSH_PULL_OP, input=[grad])
        pp.attr["T"].type = dtype
        pp.attr["tensor_name"].s = naming.graph_def_key(var, name_prefix).encode()
        pp.attr["priority"].i = 0   # ranked by the C++ priority pass
        new_nodes.append(pp)
        result = pp.name
        if average and num_workers > 1:
            scale = node_def_pb2.NodeDef(name=naming.unique_name(f"{pp.name}/scale", taken),
                                         op="Const")
            scale.attr["dtype"].type = dtype
            scale.attr["value"].tensor.CopyFrom(
                tf.make_tensor_proto(1.0 / num_workers, dtype=tf.as_dtype(dtype), shape=[]))
            mean = node_def_pb2.NodeDef(name=naming.unique_name(f"{pp.name}/average", taken),
                                        op="Mul", input=[pp.name, scale.name])
            mean.attr["T"].type = dtype
            new_nodes += [scale, mean]
            result = mean.name
        apply_node.input[index] = result
    out.node.extend(new_nodes)
    return out


def push_pull_nodes(graph_def) -> List[node_def_pb2.NodeDef]:
    """The push_pull nodes of a GraphDef (for checks and tools)."""
    return [n for n in graph_def.node if n.op == PUSH_PULL_OP]
