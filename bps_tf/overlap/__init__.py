"""Cross-step overlap: each step's push_pulls travel while the next step's
forward pass runs, layer by layer, bit-identical to the step barrier.

Two faces over one guard: ``model.fit`` under ``BytePSStrategy`` (``fit``)
and custom training loops (``OverlappedApply``, docs/overlap.md).
"""
from bps_tf.overlap.loop import OverlappedApply, unsupported_reason

__all__ = ["OverlappedApply", "unsupported_reason"]
