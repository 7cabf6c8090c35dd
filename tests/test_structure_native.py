"""The shape of bps_tf's C++: the op library reaches the core only through
its contract, the core's folders include only downwards, files stay small
and functions short.

    python tests/test_structure_native.py    prints the measures (longest
                                              functions, largest files, the
                                              include arrows between folders)

The layers of bps_tf/core, lowest first, are those of docs/engine.md ("How
the core is laid out"). The function scan is a brace matcher over the source
with comments, literals and preprocessor lines blanked out: a function is a
brace block at namespace or class scope whose head has a parameter list.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "bps_tf")
CORE = os.path.join(PACKAGE, "core")
OP_LIBRARY = ("ops", "kernels")
# What the op library may include of the core: the C ABI and the header-only dtype table
# (the contract), and the C ABI of the framework-free CUDA reduce kernels.
CONTRACT = {"bps_api.h", "dtypes.h"}
OP_LIBRARY_MAY_INCLUDE = CONTRACT | {"gpu/gpu_reduce.h"}
NATIVE = (".cc", ".h", ".cu", ".cuh")
MAX_LINES = 500
MAX_FUNCTION_LINES = 100
# The engine's hot classes keep every member function under ~80 lines.
HOT_CLASSES = ("WorkerEngine", "SumEngine", "Scheduler", "ServerNode", "LocalReduce")
MAX_HOT_FUNCTION_LINES = 80
# Folders of bps_tf/core, lowest first; a folder includes its own headers and
# those of lower layers only. The root's headers (the contract) are below
# everything, its sources (api.cc, pybind_module.cc) above everything.
CORE_LAYERS = (("common", "gpu"), ("math", "transport"), ("scheduler",), ("worker", "server"))
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def _native_files(*folders):
    out = []
    for folder in folders:
        for root, _, names in os.walk(os.path.join(PACKAGE, folder)):
            out += [os.path.join(root, n) for n in sorted(names) if n.endswith(NATIVE)]
    return sorted(out)


def _read(path):
    with open(path, errors="replace") as f:
        return f.read()


def _rel(path):
    return os.path.relpath(path, ROOT)


# ---- includes ----

def core_headers_included(path, text=None):
    """The core headers (paths under bps_tf/core) that a file of the op
    library includes, however it names them."""
    text = _read(path) if text is None else text
    core_names = {n for _, _, names in os.walk(CORE) for n in names if n.endswith(".h")}
    found = []
    for name in INCLUDE.findall(text):
        beside = os.path.normpath(os.path.join(os.path.dirname(path), name))
        if os.path.isfile(beside):
            if os.path.commonpath([beside, CORE]) == CORE:
                found.append(os.path.relpath(beside, CORE))
            continue
        # By its path under the core's include root, or by a bare core file name.
        if os.path.isfile(os.path.join(CORE, name)) or ("/" not in name and name in core_names):
            found.append(os.path.normpath(name))
    return found


def test_op_library_includes_only_the_core_contract():
    files = _native_files(*OP_LIBRARY)
    assert len(files) >= 10, files
    bad = {_rel(p): [h for h in core_headers_included(p) if h not in OP_LIBRARY_MAY_INCLUDE]
           for p in files}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, ("the op library reaches the core only through bps_api.h and dtypes.h "
                     f"(add a C entry to bps_api.h instead): {bad}")


def test_the_include_check_sees_core_headers_however_named():
    probe = os.path.join(PACKAGE, "ops", "probe.cc")
    text = ('#include "bps_api.h"\n#include "graph_util.h"\n#include "common/common.h"\n'
            '  #  include "stats.h"\n#include "../core/math/reduce.h"\n'
            '#include "tensorflow/core/graph/graph.h"\n')
    assert core_headers_included(probe, text) == [
        "bps_api.h", "common/common.h", "stats.h", "math/reduce.h"]


def _layer(folder):
    for i, group in enumerate(CORE_LAYERS):
        if folder in group:
            return i + 1
    raise AssertionError(f"bps_tf/core/{folder}/ has no layer in CORE_LAYERS")


def core_include_arrows():
    """{(from folder, to folder): [(file, header), ...]} of bps_tf/core, '' being the root."""
    arrows = {}
    for path in _native_files("core"):
        rel = os.path.relpath(path, CORE)
        for name in INCLUDE.findall(_read(path)):
            assert os.path.isfile(os.path.join(CORE, name)), (
                f"bps_tf/core/{rel} includes {name!r}: core includes are paths under bps_tf/core")
            arrows.setdefault((os.path.dirname(rel), os.path.dirname(name)), []).append((rel, name))
    return arrows


def include_points_down(rel, name):
    """Whether bps_tf/core/`rel` may include `name` (a path under bps_tf/core)."""
    src, dst = os.path.dirname(rel), os.path.dirname(name)
    if dst == "":
        return name in CONTRACT  # the contract stands below everything
    if src == "":
        return rel.endswith(".cc")  # api.cc and pybind_module.cc stand on everything
    return src == dst or _layer(dst) < _layer(src)


def test_core_folders_include_only_downwards():
    arrows = core_include_arrows()
    assert len(arrows) > 10, "no includes found under bps_tf/core"
    bad = [f"{rel} -> {name}" for uses in arrows.values() for rel, name in uses
           if not include_points_down(rel, name)]
    assert not bad, f"includes that point up or sideways between the core's folders: {bad}"


def test_the_layer_rule():
    assert include_points_down("worker/trace.cc", "common/labels.h")
    assert include_points_down("worker/worker_engine.h", "scheduler/membership.h")
    assert include_points_down("server/server_node.cc", "server/sum_engine.h")
    assert include_points_down("math/reduce.cc", "bps_api.h")
    assert include_points_down("api.cc", "worker/worker_engine.h")
    assert not include_points_down("worker/worker_io.cc", "server/sum_engine.h")  # sideways
    assert not include_points_down("transport/channel.cc", "math/reduce.h")  # sideways
    assert not include_points_down("common/stats.cc", "transport/protocol.h")  # up
    assert not include_points_down("bps_api.h", "worker/worker_engine.h")  # the contract


# ---- sizes ----

def test_native_files_are_small():
    files = _native_files(".")
    assert len(files) > 40, files
    big = {_rel(p): n for p in files if (n := _read(p).count("\n")) > MAX_LINES}
    assert not big, f"C++ files over {MAX_LINES} lines (split them along a seam): {big}"


def _blank(text):
    """The text with comments, string and character literals and preprocessor
    lines blanked out, newlines kept (so line numbers hold)."""
    out, i, n, line_start = [], 0, len(text), True
    while i < n:
        c = text[i]
        if line_start and c == "#":  # a directive, with its continuation lines
            while i < n and text[i] != "\n":
                if text.startswith("\\\n", i):
                    out.append("\n")
                    i += 1
                i += 1
            continue
        if text.startswith("//", i):
            i = text.find("\n", i)
            i = n if i < 0 else i
            continue
        if text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append("\n" * text.count("\n", i, end))
            i = end
            continue
        raw = re.match(r'R"([^(\s]*)\(', text[i:i + 20]) if c == "R" else None
        if raw and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = text.find(")" + raw.group(1) + '"', i)
            end = n if end < 0 else end + len(raw.group(1)) + 2
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end
            continue
        if c in "\"'" and not (c == "'" and i and text[i - 1].isalnum()):  # 1'000 is a number
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(c + c)
            i = j + 1
            continue
        out.append(c)
        line_start = c == "\n" or (line_start and c.isspace())
        i += 1
    return "".join(out)


SCOPE_HEAD = re.compile(r"(?:^|\s)(?:namespace|class|struct|union)\b[^()]*$|^extern\s*\"\"$")
CONTROL_HEAD = re.compile(r"^(?:if|for|while|switch|catch|do|else|try)\b")


def functions(text):
    """[(name, first line, lines)] of the functions defined in C++ `text`."""
    text = _blank(text)
    found, stack, head_from = [], [], 0
    for i, c in enumerate(text):
        at_scope = all(kind == "scope" for kind in stack)
        if c == "{":
            if not at_scope:
                stack.append("inner")
                continue
            head = " ".join(text[head_from:i].split())
            params = head.find("(")
            if SCOPE_HEAD.search(head) or head.startswith("enum") or head.endswith("extern \"\""):
                stack.append("scope" if not head.startswith("enum") else "data")
            elif params > 0 and not CONTROL_HEAD.match(head) and (
                    "=" not in head[:params] or "operator" in head[:params]):
                name = head[:params].split()[-1] if head[:params].split() else "?"
                first = text.count("\n", 0, head_from + len(text[head_from:i]) -
                                   len(text[head_from:i].lstrip())) + 1
                found.append([name, first, i])
                stack.append("function")
            else:
                stack.append("data")
            head_from = i + 1
        elif c == "}":
            kind = stack.pop() if stack else "scope"
            if kind == "function":
                entry = next(f for f in reversed(found) if len(f) == 3)
                entry[2] = text.count("\n", 0, i) + 2 - entry[1]
                entry.append(True)
            if all(k == "scope" for k in stack):
                head_from = i + 1
        elif at_scope and c == ";":
            head_from = i + 1
        elif at_scope and c == ":" and re.search(r"\b(?:public|private|protected)\s*$",
                                                 text[head_from:i]):
            head_from = i + 1
    return [(name, first, lines) for name, first, lines, _ in found]


def all_functions(*folders):
    """[(lines, file, first line, name)] over the native files of `folders`, longest first."""
    rows = [(lines, _rel(p), first, name)
            for p in _native_files(*folders) for name, first, lines in functions(_read(p))]
    return sorted(rows, key=lambda r: (-r[0], r[1], r[2]))


def test_the_function_scan_reads_cxx():
    text = '''#include "x.h"
namespace bps {
namespace {
const char* kBraces = "{ not a block }";  // nor this {
int Small(int a) { return a > 0 ? a : '{'; }
}  // namespace

class Engine {
 public:
  void Inline() const {
    auto f = [](int x) {
      return x;
    };
  }
  struct Part { int a = 0; };
};

/* { */
bool Engine::Long(const std::string& s,
                  int n) {
  for (int i = 0; i < n; ++i) {
    if (s[i] == '}') return false;
  }
  return true;
}
}  // namespace bps
'''
    assert functions(text) == [("Small", 5, 1), ("Inline", 10, 5), ("Engine::Long", 19, 7)]


def test_functions_are_short():
    rows = all_functions("core", *OP_LIBRARY)
    core = [r for r in rows if r[1].startswith(os.path.join("bps_tf", "core"))]
    assert len(core) > 300, "the function scan found too few functions in bps_tf/core"
    print("longest function: %d lines, %s:%d %s" % rows[0])
    long = [r for r in core if r[0] > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines in bps_tf/core: {long}"
    hot = [r for r in core if r[3].split("::")[0] in HOT_CLASSES and "::" in r[3]
           and r[0] > MAX_HOT_FUNCTION_LINES]
    assert not hot, f"functions of the engine's hot classes over {MAX_HOT_FUNCTION_LINES} lines: {hot}"


def main():
    rows = all_functions(".")
    print("longest functions under bps_tf/ (lines, file:line, name):")
    for lines, path, first, name in rows[:10]:
        print(f"  {lines:4d}  {path}:{first}  {name}")
    sizes = sorted(((_read(p).count("\n"), _rel(p)) for p in _native_files(".")), reverse=True)
    print(f"largest of {len(sizes)} C++ files (lines):")
    for n, path in sizes[:5]:
        print(f"  {n:4d}  {path}")
    print("include arrows between the core's folders ('' is the root):")
    for (src, dst), uses in sorted(core_include_arrows().items()):
        if src != dst:
            print(f"  {src or '(root)':10s} -> {dst or '(root)':10s} {len(uses)}")


if __name__ == "__main__":
    sys.exit(main())
