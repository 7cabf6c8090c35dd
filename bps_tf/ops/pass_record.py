"""What the C++ priority pass (bps_tf/ops/priority_pass.cc) did in this process.

The pass sets the ``priority`` attr of push_pull nodes in the graph TensorFlow
runs, so the priority a kernel receives is the one recorded here under its
tensor name (the last graph that held the name wins). ``stats()`` also
carries the pass's own timing, per graph with and without push_pull.
"""
from __future__ import annotations

import ctypes
import json
from typing import Dict

from bps_tf.ops import LIBRARY_PATH  # loading bps_tf.ops loads the library holding the pass

_LIB = ctypes.CDLL(LIBRARY_PATH)
_LIB.bps_priority_pass_stats_json.restype = ctypes.c_size_t
_LIB.bps_priority_pass_stats_json.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


def stats() -> dict:
    """{"without_push_pull": cost, "with_push_pull": cost, "priorities": {...}};
    cost: graphs, total_ns, max_ns, max_ns_nodes, max_nodes."""
    need = _LIB.bps_priority_pass_stats_json(None, 0)
    buf = ctypes.create_string_buffer(need)
    _LIB.bps_priority_pass_stats_json(buf, need)
    return json.loads(buf.value.decode())


def priorities() -> Dict[str, int]:
    """tensor_name -> the priority the pass gave that push_pull (what its kernel receives)."""
    return stats()["priorities"]


def reset() -> None:
    _LIB.bps_priority_pass_stats_reset()


def configure_graph_rewrite(on: bool, num_workers: int = 1, rank: int = 0,
                            average: bool = True) -> None:
    """Switches the TF1 graph rewrite of the pass (bps_tf/ops/graph_rewrite.cc);
    use bps_tf.compat.v1.enable_graph_rewrite()."""
    _LIB.bps_graph_rewrite_configure(int(bool(on)), int(num_workers), int(rank),
                                     int(bool(average)))
