"""BYTEPS_LOG_LEVEL sets the level of the core's and Python's logs; every
line names the worker's rank."""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_runner import ROOT, launch  # noqa: E402

CHECKS = os.path.join(ROOT, "tests", "workers", "engine_checks.py")


def _lines(tmp_path, level):
    proc = launch(2, 1, [CHECKS, "rounds", str(tmp_path)], env={"BYTEPS_LOG_LEVEL": level})
    assert proc.returncode == 0, proc.stderr
    return [l for l in (proc.stdout + proc.stderr).splitlines() if "bps_tf" in l and "] " in l]


def test_info_level_shows_core_and_python_lines_with_the_rank(tmp_path):
    lines = _lines(tmp_path, "INFO")
    for rank in (0, 1):
        mine = [l for l in lines if re.search(rf"bps_tf worker {rank}\]", l)]
        assert any("joined: rank" in l for l in mine), lines          # from the C++ core
        assert any("initialized: rank" in l for l in mine), lines     # from Python
    assert any("bps_tf server 0]" in l for l in lines)


def test_warning_level_hides_info_lines(tmp_path):
    lines = _lines(tmp_path, "WARNING")
    assert not any("joined: rank" in l or "initialized: rank" in l for l in lines), lines
