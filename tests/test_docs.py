"""Docs that are generated from code stay in step with it."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_configuration_doc_lists_every_setting_with_its_default():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gen_config_doc.py"),
                           "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, "docs/configuration.md is stale: run tools/gen_config_doc.py"
