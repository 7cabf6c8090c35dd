"""Docs that are generated from code stay in step with it."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_configuration_doc_lists_every_setting_with_its_default():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gen_config_doc.py"),
                           "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, "docs/configuration.md is stale: run tools/gen_config_doc.py"


def _commands(lines):
    return [line.strip() for line in lines
            if line.strip() and not line.strip().startswith("#")]


def test_ci_runs_exactly_the_readmes_test_instructions():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("Install and run the tests"):]
    start = section.index("```bash\n") + len("```bash\n")
    block = section[start:section.index("```", start)]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = _commands(f)
    # The lines that only set the script up (strict mode, the repository root).
    ci = [line for line in ci if not line.startswith(("set -", 'cd "$(dirname'))]
    assert ci == _commands(block.splitlines())
    # The one step that installs system packages is there, in plain sight...
    assert ci[0].startswith("apt-get update && apt-get install -y bazel-bootstrap")
    assert ci[-1].endswith("pytest -q -n 2 tests")


PACKAGE_MANAGERS = ("apt-get", "apt", "dpkg", "yum", "dnf", "apk")
RUNS = ("run", "Popen", "call", "check_call", "check_output", "system", "_run", "_apt_get")


def _package_manager_calls(path):
    """Lines of ``path`` that start a package manager as a process."""
    import ast
    with open(path) as f:
        text = f.read()
    if not any(quote + name in text for quote in "\"'" for name in PACKAGE_MANAGERS):
        return []
    tree = ast.parse(text, path)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = getattr(node.func, "attr", getattr(node.func, "id", ""))
        for arg in node.args[:1] if func in RUNS else []:
            while isinstance(arg, ast.BinOp):          # ["apt-get"] + args
                arg = arg.left
            if isinstance(arg, (ast.List, ast.Tuple)) and arg.elts:
                arg = arg.elts[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and \
                    arg.value.split(" ")[0] in PACKAGE_MANAGERS:
                found.append(node.lineno)
    return found


def test_no_test_installs_system_packages():
    # ...and no test runs a package manager behind the user's back.
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "tests")):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            found += [f"{os.path.relpath(path, ROOT)}:{n}" for n in _package_manager_calls(path)]
    assert found == [], found


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
