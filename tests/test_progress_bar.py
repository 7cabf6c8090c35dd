"""Keras' progress bar is drawn by rank 0 only (BYTEPS_PROGRESS_ALL_RANKS=1: all)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_runner import ROOT, launch  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "workers", "progress_bar.py")


def test_only_rank0_draws_the_progress_bar():
    proc = launch(2, 1, [SCRIPT], timeout=180)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "FIT_DONE rank=0" in out and "FIT_DONE rank=1" in out
    # Each epoch header is printed once (by rank 0), not once per worker.
    assert out.count("Epoch 1/2") == 1, out
    assert out.count("Epoch 2/2") == 1, out
