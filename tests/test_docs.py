"""Docs that are generated from code stay in step with it."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_configuration_doc_lists_every_setting_with_its_default():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gen_config_doc.py"),
                           "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, "docs/configuration.md is stale: run tools/gen_config_doc.py"


CODE = (".py", ".cc", ".h", ".cu", ".cuh", ".sh")


def test_the_performance_page_stays_a_summary():
    """docs/performance.md stays under 400 lines; measurement write-ups go to
    docs/performance-history.md."""
    with open(os.path.join(ROOT, "docs", "performance.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) < 400, f"docs/performance.md has {len(lines)} lines"


def test_code_cites_the_performance_docs_by_title_not_number():
    """Section numbers of docs/performance-history.md change as it grows:
    code names a section by its title (or anchor)."""
    bad = []
    for folder in ("bps_tf", "benchmarks", "tools", "tests", "examples"):
        for root, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if not name.endswith(CODE):
                    continue
                path = os.path.join(root, name)
                if os.path.samefile(path, __file__):
                    continue
                with open(path, errors="replace") as f:
                    for number, line in enumerate(f, 1):
                        if "performance" in line and ("\u00a7" in line or " section 1" in line
                                                      or " section 2" in line):
                            bad.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not bad, "\n".join(bad)
