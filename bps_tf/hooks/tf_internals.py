"""TensorFlow internals bps_tf uses, each a registry entry: the modules of
``tensorflow.python`` whose names TensorFlow offers no public API for, the
private methods ``BytePSExtended`` overrides, and two private methods
called (docs/dependencies.md lists them; what is public, such as
``tf.distribute.DistributedValues`` or ``tf.IndexedSlices``, is used
through ``tf`` instead).

Every other bps_tf module reaches these names through the handles below
(``tf_internals.MIRRORED.MirroredExtended``), never by importing
``tensorflow.python`` itself (tests/test_structure.py checks it). A handle
of an ``error`` entry raises HookError naming the entry and the versions
when its target moved; a ``fallback`` one answers ``available() == False``.
"""
from __future__ import annotations

from bps_tf.hooks import registry
from bps_tf.hooks.entries import Internal, defined_by

_STRATEGY = ("BytePSStrategy is a MirroredStrategy whose extended class reduces through the "
             "servers; tf.distribute's public API has no way to subclass a strategy")

MIRRORED = Internal(
    "tf distribute.mirrored_strategy", "strategy.tf",
    "tensorflow.python.distribute.mirrored_strategy", ["MirroredExtended"],
    changes="BytePSExtended subclasses MirroredExtended", why=_STRATEGY)
CROSS_DEVICE_OPS = Internal(
    "tf distribute.cross_device_ops", "strategy.tf",
    "tensorflow.python.distribute.cross_device_ops",
    ["check_destinations", "reduce_non_distributed_value"],
    changes="the strategy's reductions check destinations and reduce plain values as "
            "MirroredStrategy does", why=_STRATEGY)
DISTRIBUTE_UTILS = Internal(
    "tf distribute.distribute_utils", "strategy.tf",
    "tensorflow.python.distribute.distribute_utils", ["is_mirrored", "regroup"],
    changes="per-replica values regrouped and mirrored variables told apart", why=_STRATEGY)
INPUT_UTIL = Internal(
    "tf distribute.input_util", "strategy.tf", "tensorflow.python.distribute.input_util",
    ["get_distributed_dataset", "get_distributed_datasets_from_function"],
    changes="distributed datasets sharded by worker", why=_STRATEGY)
VALUES = Internal(
    "tf distribute.values", "strategy.tf", "tensorflow.python.distribute.values",
    ["DistributedVariable", "SyncOnReadVariable"],
    changes="a replica-context update of a state variable told apart from a gradient",
    why=_STRATEGY)
TRACKABLE = Internal(
    "tf trackable.base", "strategy.tf", "tensorflow.python.trackable.base",
    ["CheckpointInitialValue"],
    changes="a variable restored from a checkpoint starts from its restored value, not "
            "rank 0's", why="a checkpoint's initial value is a private wrapper type")
# The private methods BytePSExtended (and bps_tf.distribute's) override: a
# release that renamed one would silently bypass bps_tf's version.
OVERRIDDEN = ("_num_replicas_in_sync", "_in_multi_worker_mode",
              "_get_replica_id_in_sync_group", "_get_local_replica_id", "_use_merge_call",
              "_get_cross_device_ops", "_reduce_to", "_batch_reduce_to",
              "_gather_to_implementation", "_broadcast_to", "_update",
              "_experimental_distribute_dataset", "_distribute_datasets_from_function",
              "_experimental_distribute_values_from_function", "_create_variable",
              "_get_variable_creator_initial_value")


def _overridden():
    base = MIRRORED.MirroredExtended
    gone = [name for name in OVERRIDDEN if not any(name in vars(c) for c in base.__mro__)]
    if gone:
        raise registry.HookMissing(f"MirroredExtended no longer defines {', '.join(gone)}")
    return base, OVERRIDDEN[0]


_overridden.found_by = ("role: the methods of MirroredExtended's MRO that BytePSExtended "
                        "overrides (" + ", ".join(OVERRIDDEN) + ")")
_overridden.keras_name = ""
registry.probe("tf MirroredExtended (overridden methods)", "strategy.tf", _overridden,
               changes="BytePSExtended's reductions, input sharding, replica ids and variable "
                       "creation replace MirroredStrategy's", why=_STRATEGY, when_missing="error")

# ... and those of CrossDeviceOps that PushPullCrossDeviceOps overrides or
# calls (with one device per worker TensorFlow skips a cross-device op
# whose _num_between_graph_workers says there is one worker).
CDO_OVERRIDDEN = ("_num_between_graph_workers", "_gather", "_gather_implementation")


def _cdo_overridden():
    base = registry.public("tensorflow.distribute.CrossDeviceOps")
    gone = [name for name in CDO_OVERRIDDEN if not any(name in vars(c) for c in base.__mro__)]
    if gone:
        raise registry.HookMissing(f"CrossDeviceOps no longer defines {', '.join(gone)}")
    return base, CDO_OVERRIDDEN[0]


_cdo_overridden.found_by = ("role: the methods of tf.distribute.CrossDeviceOps that "
                            "PushPullCrossDeviceOps overrides or calls (" +
                            ", ".join(CDO_OVERRIDDEN) + ")")
_cdo_overridden.keras_name = ""
registry.probe("tf CrossDeviceOps (overridden methods)", "strategy.tf", _cdo_overridden,
               changes="every reduction and gather of the strategy goes through the servers, "
                       "one device per worker included", why=_STRATEGY, when_missing="error")

OP_DEF_REGISTRY = Internal(
    "tf framework.op_def_registry", "compat.tf1", "tensorflow.python.framework.op_def_registry",
    ["get"], changes="the TF1 rewriter finds the gradient input of an optimizer op",
    why="TensorFlow has no public lookup of an op's definition by type",
    feature="the TF1 graph rewrite (enable_graph_rewrite)")
EAGER_RECORD = Internal(
    "tf eager.record", "overlap.loop", "tensorflow.python.eager.record", ["stop_recording"],
    changes="OverlappedApply's deferred updates stay out of the user's GradientTape",
    why="a GradientTape can pause only itself; the deferred update runs inside the user's "
        "tape, which bps_tf does not hold", when_missing="fallback")
CONTROL_FLOW_UTIL = Internal(
    "tf ops.control_flow_util", "comm", "tensorflow.python.ops.control_flow_util",
    ["GraphOrParentsInXlaContext"],
    changes="a push_pull inside an XLA-compiled function is refused at once, naming the fix",
    why="TensorFlow does not say publicly whether a graph is compiled by XLA",
    when_missing="fallback")
KERNELS = Internal(
    "tf framework.kernels", "comm", "tensorflow.python.framework.kernels",
    ["get_registered_kernels_for_op"],
    changes="the device types of the loaded push_pull kernels (GPU build or not)",
    why="TensorFlow has no public list of an op's registered kernels", when_missing="fallback")
registry.probe("tf Graph._attr_scope", "comm",
               defined_by(lambda: registry.public("tensorflow.Graph"), "_attr_scope",
                          "tf.Graph"),
               changes="push_pulls made in a scope keep the priority given to them (an attr "
                       "the C++ priority pass reads)",
               why="TensorFlow sets attributes of the ops of a scope only through this "
                   "private scope", when_missing="fallback")


def attr_scope(graph, attrs):
    """``graph``'s scope that sets ``attrs`` on the ops made in it, or a scope
    that sets nothing when this TensorFlow moved it (a warning says what is
    lost: the priorities of those push_pulls come from the graph)."""
    import contextlib
    if not registry.locate_entry("tf Graph._attr_scope"):
        registry.warn_fallback("comm", "push_pulls keep the priority the graph gives them")
        return contextlib.nullcontext()
    return graph._attr_scope(attrs)  # pylint: disable=protected-access


def in_xla_context(graph) -> bool:
    """Whether ``graph`` (or a graph it is nested in) is compiled by XLA;
    False when this TensorFlow moved the test (the op then fails inside XLA
    with TensorFlow's own error instead of bps_tf's)."""
    if not CONTROL_FLOW_UTIL.available():
        registry.warn_fallback("comm", "a push_pull inside XLA-compiled code fails with "
                                       "TensorFlow's error instead of naming the fix")
        return False
    return bool(CONTROL_FLOW_UTIL.GraphOrParentsInXlaContext(graph))


def kernel_devices(op_type: str) -> set:
    """Device types with a kernel registered for ``op_type``; {"CPU"} when
    this TensorFlow moved the list (a GPU build then reports no GPU kernel
    to Horovod's ``cuda_built()``)."""
    if not KERNELS.available():
        registry.warn_fallback("comm", "cuda_built() reports the CPU kernels only")
        return {"CPU"}
    return {k.device_type for k in KERNELS.get_registered_kernels_for_op(op_type).kernel}
