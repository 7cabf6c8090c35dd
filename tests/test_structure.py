"""The shape of the bps_tf package: modules import alone, no import circles
(lazy imports included), imports that point down the layers of
docs/architecture.md, no private names across modules, small files, two
modules on the op wrappers, and ``from bps_tf import *`` gives the
documented API.

The static checks read the source tree (tests/../bps_tf); the import checks
run the installed package in fresh subprocesses.
"""
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "bps_tf")
MAX_LINES = 500
# Modules allowed to call the op wrappers of bps_tf.ops.
OP_USERS = {"bps_tf.comm.collectives", "bps_tf.comm.gradients"}
# The layers, lowest first (docs/architecture.md, "Layers"). A module's
# group is its subpackage (a top-level module is a group of its own); an
# import between two groups must point to a lower layer, so groups of one
# layer never import each other.
LAYERS = (
    ("runtime", ("bps_tf.runtime",)),
    ("hooks", ("bps_tf.hooks",)),
    ("ops", ("bps_tf.ops",)),
    ("comm", ("bps_tf.comm",)),
    ("engines", ("bps_tf.overlap", "bps_tf.launch")),
    # The two faces (and TF1's) are siblings: each builds on comm/ alone.
    ("faces", ("bps_tf.horovod", "bps_tf.strategy", "bps_tf.compat")),
    ("keras", ("bps_tf.keras",)),
    ("public", ("bps_tf", "bps_tf.server", "bps_tf.distribute", "bps_tf.util",
                "bps_tf.elastic", "bps_tf.mpi_ops", "bps_tf.launcher", "bps_tf.op_build")),
)
DOCUMENTED = {"init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
              "push_pull", "allreduce", "allgather", "grouped_allreduce", "broadcast",
              "broadcast_variables", "broadcast_object", "allgather_object", "DistributedGradientTape",
              "Compression", "Average", "Sum", "Adasum", "Min", "Max", "Product",
              "DistributedOptimizer", "BytePSStrategy", "gather_predictions",
              "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
              "grouped_allgather", "reducescatter", "grouped_reducescatter", "alltoall",
              "alltoall_cpu2gpu", "alltoall_gpu2cpu",
              "barrier", "broadcast_", "size_op", "rank_op", "local_size_op", "local_rank_op",
              "SyncBatchNormalization", "mpi_built", "gloo_built", "nccl_built", "ddl_built",
              "ccl_built", "cuda_built", "rocm_built", "mpi_enabled", "gloo_enabled",
              "mpi_threads_supported", "join", "sycl_built", "process_set_included_op",
              "cross_rank", "cross_size", "is_homogeneous", "start_timeline", "stop_timeline"}


def _module_files():
    """{module name: path} of every .py file of the package."""
    out = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, REPO)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = path
    return dict(sorted(out.items()))


MODULES = _module_files()


def _tree(module):
    with open(MODULES[module]) as f:
        return ast.parse(f.read(), MODULES[module])


def _resolve(module, node):
    """Absolute module name of an ImportFrom (relative imports included)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if MODULES[module].endswith("__init__.py") \
        else module.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module, top_level_only):
    """(imported bps_tf module, [names taken from it], local alias) of ``module``."""
    tree = _tree(module)
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("bps_tf"):
                    out.append((alias.name, [], alias.asname))
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            if not source.startswith("bps_tf"):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in MODULES:      # `from bps_tf import api`: a module
                    out.append((sub, [], alias.asname or alias.name))
                else:
                    out.append((source, [alias.name], None))
    return out


def _group(module):
    """The subpackage a module belongs to (itself for a top-level module)."""
    return ".".join(module.split(".")[:2])


def _layer(module):
    group = _group(module)
    for index, (_, groups) in enumerate(LAYERS):
        if group in groups:
            return index
    raise AssertionError(f"{module}: its group {group} is in no layer of LAYERS "
                         "(add it, and to docs/architecture.md)")


def _graph():
    """{module: {bps_tf modules it imports anywhere in its body}}."""
    graph = {m: set() for m in MODULES}
    for module in MODULES:
        for target, _, _ in _imports(module, top_level_only=False):
            # Importing bps_tf.x runs bps_tf/__init__ first: the package is
            # part of the path, so edges go to the module itself.
            if target in MODULES and target != module:
                graph[module].add(target)
    return graph


def test_modules_found():
    for name in ("bps_tf.comm.collectives", "bps_tf.comm.naming", "bps_tf.horovod.api",
                 "bps_tf.strategy", "bps_tf.strategy.cross_device_ops",
                 "bps_tf.strategy.keras_hooks", "bps_tf.compat.tf1_rewriter",
                 "bps_tf.runtime.basics", "bps_tf.overlap.fit"):
        assert name in MODULES


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_imports_point_down_the_layers():
    up = []
    for module, targets in _graph().items():
        for target in targets:
            if _group(target) != _group(module) and _layer(target) >= _layer(module):
                up.append(f"{module} ({LAYERS[_layer(module)][0]}) imports {target} "
                          f"({LAYERS[_layer(target)][0]})")
    assert not up, "imports that do not point down the layers:\n" + "\n".join(sorted(up))


def test_the_structure_test_sees_lazy_imports():
    # The checks read function bodies and module-level ifs too.
    graph = _graph()
    assert "bps_tf.horovod.sync_batch_norm_legacy" in graph["bps_tf.horovod.sync_batch_norm"]
    assert "bps_tf.comm.gradients" in graph["bps_tf.comm.collectives"]


# Imports each module in a child forked from a process that has imported
# TensorFlow and Keras but no bps_tf: every module starts from a bps_tf-free
# interpreter (as alone as a fresh process), without paying TensorFlow's
# start-up once per module.
_IMPORT_EACH = r"""
import json, os, sys, traceback
import tensorflow, keras  # noqa: F401  (shared by every child; not bps_tf)
assert not any(m == "bps_tf" or m.startswith("bps_tf.") for m in sys.modules)
results = {}
for module in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            __import__(module)
            message = ""
        except BaseException:  # noqa: B036  (any failure is the finding)
            message = traceback.format_exc()[-3000:] or "failed"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while True:
        chunk = os.read(read, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    message = b"".join(chunks).decode()
    if status != 0 and not message:
        message = f"the child importing it exited with status {status}"
    results[module] = message
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def import_errors():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("DMLC_ROLE", None)
    # A neutral directory: the source tree must not shadow the installed package.
    out = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *MODULES],
                         cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True,
                         timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULTS ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_module_imports_alone(module, import_errors):
    assert import_errors[module] == "", import_errors[module]


def test_no_import_cycle():
    graph = _graph()
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in MODULES:
        if m not in state:
            visit(m)


def test_no_private_names_across_modules():
    bad = []
    for module in MODULES:
        aliases = {}
        for target, names, alias in _imports(module, top_level_only=False):
            if target == module:
                continue
            bad += [f"{module}: from {target} import {n}" for n in names
                    if n.startswith("_") and not n.startswith("__")]
            if alias:
                aliases[alias] = target
        for node in ast.walk(_tree(module)):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                bad.append(f"{module}: {node.value.id}.{node.attr} ({aliases[node.value.id]})")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


def test_tensorflow_and_keras_internals_are_reached_only_through_the_registry():
    """``tensorflow.python`` and ``keras.src`` are imported by bps_tf.hooks
    alone (its entries name each internal; docs/dependencies.md lists them)."""
    bad = []
    for module in MODULES:
        if module == "bps_tf.hooks" or module.startswith("bps_tf.hooks."):
            continue
        for node in ast.walk(_tree(module)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{module}: imports {n}" for n in names
                    if n.startswith(("tensorflow.python", "keras.src"))]
    assert not bad, "internals imported outside bps_tf/hooks:\n" + "\n".join(bad)


def test_files_are_small():
    long = []
    for module, path in MODULES.items():
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            long.append(f"{path}: {n} lines")
    assert not long, f"files over {MAX_LINES} lines:\n" + "\n".join(long)


def test_only_collectives_uses_the_op_wrappers():
    users = set()
    for module in MODULES:
        if module == "bps_tf.ops" or module.startswith("bps_tf.ops."):
            continue
        for target, _, _ in _imports(module, top_level_only=False):
            if target == "bps_tf.ops" or target.startswith("bps_tf.ops."):
                users.add(module)
        with open(MODULES[module]) as f:
            if "_ops()" in f.read():
                users.add(module)
    assert users == OP_USERS


def test_star_import_gives_the_documented_api():
    code = ("import sys\n"
            "import bps_tf\n"
            "assert 'tensorflow' not in sys.modules, 'import bps_tf imported TensorFlow'\n"
            "ns = {}\n"
            "exec('from bps_tf import *', ns)\n"
            "print(' '.join(sorted(k for k in ns if not k.startswith('__'))))\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, "-c", code], cwd=tempfile.gettempdir(), env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    names = set(out.stdout.split())
    assert DOCUMENTED <= names, DOCUMENTED - names


@pytest.mark.parametrize("module, expected", [
    ("bps_tf.launch", "usage: bpslaunch"), ("bps_tf.launcher", "usage: bpslaunch"),
    ("bps_tf.op_build", "usage: python -m bps_tf.op_build")])
def test_documented_module_entry_points_run(module, expected, tmp_path):
    """`python -m` paths that scripts and images call (older ones included)
    still run, from a folder outside the source tree."""
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert expected in out.stdout


def test_a_source_folder_that_shadows_the_installed_package_says_so(tmp_path):
    """A script in a clone's root imports the clone's bps_tf (Python puts the
    script's folder first on sys.path), which has no built core: the error
    says so, names the folder and the installed package, and gives the fix,
    instead of asking to install what is installed."""
    clone = tmp_path / "clone"
    shutil.copytree(PACKAGE, clone / "bps_tf", ignore=shutil.ignore_patterns(
        "*.so", "__pycache__", "*.cc", "*.h", "*.cu", "*.cuh"))
    (clone / "setup.py").write_text("# the clone's build script\n")
    (clone / "my_train.py").write_text("import bps_tf\nbps_tf.init()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DMLC_ROLE", "TF_CONFIG")}
    out = subprocess.run([sys.executable, "my_train.py"], cwd=clone, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "Run from another directory, or build in place" in out.stderr, out.stderr[-3000:]
    assert f"from the source folder {clone / 'bps_tf'}" in out.stderr, out.stderr[-3000:]
    assert "bps_tf is installed (in " in out.stderr, out.stderr[-3000:]
