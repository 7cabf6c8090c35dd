"""setup.py and BUILD compile the same native sources.

setup.py lists its sources by name; BUILD globs them. A file added to one and
not the other would build with pip and fail with Bazel (or the reverse) only
at link time, so this checks both against the tree.
"""
import ast
import fnmatch
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = os.path.join(ROOT, "bps_tf", "core")
PYTHON_MODULE = "pybind_module.cc"


def _literal(path, names):
    """{name: value} of the module-level literal assignments `names` in `path`."""
    with open(path) as f:
        tree = ast.parse(f.read())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = getattr(node.targets[0], "id", None)
            if name in names:
                found[name] = ast.literal_eval(node.value)
    return found


def _setup_lists():
    """setup.py's core sources; the op sources come from bps_tf/runtime/op_build.py,
    which setup.py and the build at first import share."""
    core = _literal(os.path.join(ROOT, "setup.py"), {"CORE_SOURCES"})
    assert "CORE_SOURCES" in core, "setup.py no longer names its sources"
    ops = _literal(os.path.join(ROOT, "bps_tf", "op_build.py"), {"OP_SOURCES"})
    assert "OP_SOURCES" in ops, "bps_tf/runtime/op_build.py no longer names the op sources"
    return core["CORE_SOURCES"], ["bps_tf/" + s for s in ops["OP_SOURCES"]]


def _core_files():
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(CORE, "*.cc"))
                  if os.path.basename(p) != PYTHON_MODULE)


def _bazel_target(name):
    """The text of one cc_binary in BUILD, by its name."""
    with open(os.path.join(ROOT, "BUILD")) as f:
        text = f.read()
    start = text.index(f'name = "{name}"')
    end = text.find("\ncc_binary(", start)
    return text[start:] if end < 0 else text[start:end]


def test_setup_lists_every_core_source_and_nothing_else():
    core, _ = _setup_lists()
    assert len(core) == len(set(core)), "a core source is listed twice in setup.py"
    assert PYTHON_MODULE not in core, "pybind_module.cc belongs to the Python module, not the core"
    on_disk = _core_files()
    assert sorted(core) == on_disk, (
        f"setup.py CORE_SOURCES misses {sorted(set(on_disk) - set(core))} "
        f"and lists missing files {sorted(set(core) - set(on_disk))}")


def test_setup_op_sources_exist():
    _, ops = _setup_lists()
    for src in ops:
        assert os.path.isfile(os.path.join(ROOT, src)), f"OP_SOURCES names missing {src}"


def test_bazel_core_glob_covers_the_same_sources():
    target = _bazel_target("bps_tf/libbps_core.so")
    includes = re.findall(r'"(bps_tf/core/[^"]*\.cc)"', target.split("exclude")[0])
    excludes = re.findall(r'exclude\s*=\s*\[([^\]]*)\]', target)
    excluded = re.findall(r'"([^"]+)"', excludes[0]) if excludes else []
    rel = [f"bps_tf/core/{f}" for f in _core_files() + [PYTHON_MODULE]]
    covered = sorted(os.path.basename(p) for p in rel
                     if any(fnmatch.fnmatch(p, g) for g in includes)
                     and not any(fnmatch.fnmatch(p, x) for x in excluded))
    core, _ = _setup_lists()
    assert covered == sorted(core)


def test_bazel_op_library_lists_the_op_sources():
    target = _bazel_target("bps_tf/ops/libbps_tf_ops.so")
    _, ops = _setup_lists()
    for src in ops:
        assert f'"{src}"' in target, f"BUILD's op library does not compile {src}"
    for header in re.findall(r'"(bps_tf/kernels/[^"]+\.h)"', target):
        assert os.path.isfile(os.path.join(ROOT, header)), f"BUILD names missing {header}"
