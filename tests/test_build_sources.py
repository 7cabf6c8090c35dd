"""setup.py and BUILD compile the same native sources, and what ships builds.

setup.py lists its sources by path under bps_tf/core; BUILD globs them. A file
added to one and not the other would build with pip and fail with Bazel (or
the reverse) only at link time, so this checks both against the tree. The op
library is compiled at first import from the installed package: every
header it includes must ship (package_data) and take part in its cache key
(bps_tf/ops/op_build.py), or an edited header would reuse a stale build.
"""
import ast
import glob
import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "bps_tf")
CORE = os.path.join(PACKAGE, "core")
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


def _op_build():
    # By path, as setup.py loads it: importing bps_tf would need its native parts.
    spec = importlib.util.spec_from_file_location(
        "bps_tf_op_build_for_tests", os.path.join(PACKAGE, "ops", "op_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _setup_lists():
    """setup.py's core sources; the op sources come from bps_tf/ops/op_build.py,
    which setup.py and the build at first import share."""
    core = _literal(os.path.join(ROOT, "setup.py"), {"CORE_SOURCES"})
    assert "CORE_SOURCES" in core, "setup.py no longer names its sources"
    return core["CORE_SOURCES"], ["bps_tf/" + s for s in _op_build().OP_SOURCES]


def _core_files(ext=".cc"):
    """Files under bps_tf/core, as paths relative to it (the core's include root)."""
    return sorted(os.path.relpath(p, CORE)
                  for p in glob.glob(os.path.join(CORE, "**", "*" + ext), recursive=True)
                  if os.path.basename(p) != PYTHON_MODULE)


def _glob_regex(pattern, bazel):
    """A regex for one glob pattern: Bazel's (`**/` is any number of folders)
    or setuptools' (a `*` never crosses a `/`)."""
    out, i = "", 0
    while i < len(pattern):
        if bazel and pattern.startswith("**/", i):
            out, i = out + "(?:[^/]+/)*", i + 3
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


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
    assert on_disk, "no core sources found under bps_tf/core"
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
    covered = sorted(os.path.relpath(p, "bps_tf/core") for p in rel
                     if any(_glob_regex(g, bazel=True).match(p) for g in includes)
                     and not any(_glob_regex(x, bazel=True).match(p) for x in excluded))
    core, _ = _setup_lists()
    assert covered == sorted(core)


def test_bazel_core_headers_cover_every_header():
    with open(os.path.join(ROOT, "BUILD")) as f:
        text = f.read()
    start = text.index('name = "core_headers"')
    patterns = re.findall(r'"(bps_tf/core/[^"]*\.h)"', text[start:text.index(")", start)])
    missing = [h for h in _core_files(".h")
               if not any(_glob_regex(g, bazel=True).match("bps_tf/core/" + h) for g in patterns)]
    assert not missing, f"BUILD's core_headers leaves out {missing}"


def test_bazel_op_library_lists_the_op_sources():
    target = _bazel_target("bps_tf/ops/libbps_tf_ops.so")
    _, ops = _setup_lists()
    for src in ops:
        assert f'"{src}"' in target, f"BUILD's op library does not compile {src}"
    for header in re.findall(r'"(bps_tf/(?:kernels|ops)/[^"]+\.h)"', target):
        assert os.path.isfile(os.path.join(ROOT, header)), f"BUILD names missing {header}"


def _package_data():
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "package_data":
            return ast.literal_eval(node.value)["bps_tf"]
    raise AssertionError("setup.py has no package_data for bps_tf")


def test_every_native_source_and_header_ships():
    """What the op library is compiled from at first import, and every core
    header, are in the installed package."""
    patterns = [_glob_regex(p, bazel=False) for p in _package_data()]
    _, ops = _setup_lists()
    wanted = [os.path.relpath(os.path.join(ROOT, s), PACKAGE) for s in ops]
    wanted += ["core/" + h for h in _core_files(".h")]
    for d in ("ops", "kernels"):
        wanted += [os.path.relpath(p, PACKAGE) for p in glob.glob(os.path.join(PACKAGE, d, "*.h"))]
    missing = sorted(w for w in wanted if not any(p.match(w) for p in patterns))
    assert not missing, f"setup.py's package_data does not ship {missing}"


def _included(path, include_dirs):
    """The project headers `path` includes, transitively (quoted includes
    resolved beside the file, then in the include roots, as the compiler does)."""
    seen, todo = set(), [path]
    while todo:
        current = todo.pop()
        with open(current) as f:
            names = re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read(), re.M)
        for name in names:
            for base in [os.path.dirname(current)] + list(include_dirs):
                found = os.path.normpath(os.path.join(base, name))
                if os.path.isfile(found):
                    if found not in seen:
                        seen.add(found)
                        todo.append(found)
                    break
    return seen


def test_op_library_cache_key_hashes_every_header_it_includes():
    op_build = _op_build()
    roots = [os.path.join(PACKAGE, d) for d in op_build.INCLUDE_DIRS]
    hashed = {os.path.normpath(p) for p in op_build._source_paths(PACKAGE)}
    for src in op_build.OP_SOURCES:
        path = os.path.join(PACKAGE, src)
        assert os.path.normpath(path) in hashed, f"the cache key leaves out {src}"
        unhashed = sorted(os.path.relpath(h, PACKAGE)
                          for h in _included(path, roots) - hashed)
        assert not unhashed, (f"{src} includes {unhashed}, which the op library's cache key "
                              "does not hash (bps_tf/ops/op_build.py)")


def test_each_op_source_compiles_in_exactly_one_unit():
    op_build = _op_build()
    sources = [src for unit in op_build.OP_UNITS for src in unit]
    assert len(sources) == len(set(sources)), sources
    assert tuple(sources) == op_build.OP_SOURCES
