"""The Bazel build (WORKSPACE, BUILD, .bazelrc, bazel/) produces a working bps_tf.

The build needs Debian's Bazel 4 (`bazel-bootstrap`) and `bazel-rules-java`.
The test installs nothing: the README's test instructions install them, in
plain sight, before the test command (and .ci/run does the same). Without
them the test fails, saying so. Bazel runs in batch mode, so no
Bazel server outlives the test. Its output root is a cache in the temporary
directory, outside the repository: an output base inside the workspace would
get a link back to the workspace (a cycle), and keeping it between runs means
a rerun only recompiles what changed.

Each check runs in a subprocess: the Bazel-built libraries must not meet the
pip-built ones already loaded into the test process.
"""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The machine's temporary folder, not the session's (tests/conftest.py): a
# cache kept between runs on purpose.
OUTPUT_ROOT = os.path.join(os.environ.get("BPS_TEST_CACHE_TMPDIR") or tempfile.gettempdir(),
                           f"bps_tf-bazel-{os.getuid()}")
# Bazel keys its output base by the workspace path; the convenience links
# must be per clone too, or two clones tested at once overwrite each other's.
LINKS = os.path.join(OUTPUT_ROOT, "links", hashlib.sha256(ROOT.encode()).hexdigest()[:16])
DEBIAN_PACKAGES = {"bazel-bootstrap": "bazel", "bazel-rules-java": "/usr/share/bazel/rules/java"}
INSTALL = "apt-get update && apt-get install -y " + " ".join(DEBIAN_PACKAGES)
BUILD_TIMEOUT_S = 600
CHECK_TIMEOUT_S = 240
INTERRUPT_GRACE_S = 30     # Bazel cancels its actions on SIGINT; then SIGKILL

CORE = "bps_tf/libbps_core.so"
OPS = "bps_tf/ops/libbps_tf_ops.so"


def _missing_packages():
    missing = []
    for package, provides in DEBIAN_PACKAGES.items():
        present = os.path.exists(provides) if provides.startswith("/") else shutil.which(provides)
        if not present:
            missing.append(package)
    return missing


def _require_bazel():
    missing = _missing_packages()
    if missing:
        pytest.fail(f"the Bazel build cannot be tested: Debian's {' and '.join(missing)} "
                    f"{'is' if len(missing) == 1 else 'are'} not installed. Install them first, "
                    f"as root, as the README's test instructions say: {INSTALL}", pytrace=False)


def _workspace():
    """Where Bazel builds: the clone itself, or, when its path holds a space
    (Bazel refuses those), a copy of the sources Bazel reads under OUTPUT_ROOT."""
    if not any(c.isspace() for c in ROOT):
        return ROOT
    copy = os.path.join(OUTPUT_ROOT, "workspace", hashlib.sha256(ROOT.encode()).hexdigest()[:16])
    shutil.rmtree(copy, ignore_errors=True)
    os.makedirs(copy)
    for name in ("WORKSPACE", "BUILD", ".bazelrc", ".bazelignore"):
        if os.path.exists(os.path.join(ROOT, name)):
            shutil.copy(os.path.join(ROOT, name), copy)
    shutil.copytree(os.path.join(ROOT, "bazel"), os.path.join(copy, "bazel"))
    shutil.copytree(os.path.join(ROOT, "bps_tf"), os.path.join(copy, "bps_tf"),
                    ignore=shutil.ignore_patterns("*.so", "*.so.key", "__pycache__"))
    return copy


def _run_bazel_build():
    os.makedirs(LINKS, exist_ok=True)
    cmd = ["bazel", f"--output_user_root={OUTPUT_ROOT}", "--nohome_rc", "--batch", "build",
           # Convenience links go next to the output, not into the source tree.
           f"--symlink_prefix={os.path.join(LINKS, 'bazel-')}",
           "--experimental_no_product_name_out_symlink",
           # The test checks that the build works, not how fast its code runs:
           # unoptimised, it compiles in about half the time on 2 cores.
           "--compilation_mode=fastbuild", "--copt=-O0",
           # Build against this interpreter's TensorFlow, whatever is on PATH.
           f"--repo_env=PYTHON_BIN_PATH={sys.executable}",
           "//:bps_tf_native"]
    proc = subprocess.Popen(cmd, cwd=_workspace(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            output, _ = proc.communicate(timeout=INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        pytest.fail(f"bazel build took over {BUILD_TIMEOUT_S} s:\n{output[-4000:]}")
    assert proc.returncode == 0, f"bazel build failed:\n{output[-6000:]}"
    bazel_bin = os.path.realpath(os.path.join(LINKS, "bazel-bin"))
    return bazel_bin


@pytest.fixture(scope="module")
def bazel_bin():
    _require_bazel()
    return _run_bazel_build()


def _python(code, cwd, env_extra=None):
    env = {k: v for k, v in os.environ.items()
           if k != "TF_CONFIG" and not k.startswith("DMLC_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", **(env_extra or {}))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bazel_op_library_registers_the_ops(bazel_bin, tmp_path):
    for path in (CORE, OPS):
        assert os.path.isfile(os.path.join(bazel_bin, path)), path
    seen = _python(f"""
        import ctypes, json
        from bps_tf.runtime.loader import preload_libzmq
        # The core leaves libzmq undefined, and the op library needs the core's
        # symbols: load both globally first, as bps_tf.ops does.
        preload_libzmq()
        ctypes.CDLL({os.path.join(bazel_bin, CORE)!r}, mode=ctypes.RTLD_GLOBAL)
        import tensorflow as tf
        from tensorflow.python.framework import op_def_registry
        module = tf.load_op_library({os.path.join(bazel_bin, OPS)!r})
        names = ["BytepsPushPull", "BytepsBroadcast"]
        print(json.dumps({{
            "registered": [n for n in names if op_def_registry.get(n) is not None],
            "wrappers": [w for w in ("byteps_push_pull", "byteps_broadcast") if hasattr(module, w)],
        }}))
    """, cwd=str(tmp_path), env_extra={"PYTHONPATH": ROOT})
    assert seen["registered"] == ["BytepsPushPull", "BytepsBroadcast"]
    assert seen["wrappers"] == ["byteps_push_pull", "byteps_broadcast"]


def test_bazel_outputs_work_as_the_package(bazel_bin, tmp_path):
    # The Bazel outputs mirror the package layout (and its rpaths), so a copy
    # of the Python sources plus them is a complete bps_tf.
    stage = tmp_path / "stage"
    shutil.copytree(os.path.join(ROOT, "bps_tf"), stage / "bps_tf",
                    ignore=shutil.ignore_patterns("*.so", "*.so.key", "__pycache__", "*.cu"))
    suffix = next(f for f in os.listdir(os.path.join(bazel_bin, "bps_tf"))
                  if f.startswith("_core") and f.endswith(".so"))
    for path in (CORE, OPS, "bps_tf/" + suffix):
        shutil.copy(os.path.join(bazel_bin, path), stage / path)
    # Bazel built the op library against this TensorFlow: say so, as a
    # packaging step would, or bps_tf rightly refuses to trust it.
    stamp = subprocess.run([sys.executable, "-m", "bps_tf.op_build", "--stamp", str(stage / OPS)],
                           cwd=str(tmp_path), capture_output=True, text=True, timeout=CHECK_TIMEOUT_S,
                           env=dict(os.environ, PYTHONPATH=str(stage), TF_CPP_MIN_LOG_LEVEL="2"))
    assert stamp.returncode == 0, stamp.stderr
    seen = _python("""
        import json, os
        import tensorflow as tf
        import bps_tf
        from bps_tf import ops
        from bps_tf.runtime import basics
        bps_tf.init()
        out = ops.push_pull_sum(tf.constant([1.5, -2.0, 3.25]), "bazel_smoke")
        with open("/proc/self/maps") as f:
            # Match on the file name only: the clone's folder (and a venv in it)
            # may itself be called bps_tf.
            ours = ("libbps_core.so", "libbps_tf_ops.so")
            # The path is everything after the fifth field (it may hold spaces).
            fields = [line.rstrip("\\n").split(maxsplit=5) for line in f]
            paths = {x[5] for x in fields if len(x) == 6 and x[5].startswith("/")}
            def ours_(p):
                name, parent = os.path.basename(p), os.path.basename(os.path.dirname(p))
                return name in ours or (name.startswith("_core.") and name.endswith(".so")
                                        and parent == "bps_tf")
            loaded = sorted(p for p in paths if ours_(p))
        print(json.dumps({"size": bps_tf.size(), "sum": out.numpy().tolist(),
                          "package": bps_tf.__file__, "core": basics.core().__file__,
                          "loaded": loaded}))
    """, cwd=str(tmp_path), env_extra={"PYTHONPATH": str(stage)})
    assert seen["size"] == 1 and seen["sum"] == [1.5, -2.0, 3.25]
    assert seen["package"].startswith(str(stage)) and seen["core"].startswith(str(stage))
    # Exactly the staged libraries, none of the pip-built ones.
    assert seen["loaded"] == sorted(str(stage / p) for p in (CORE, OPS, "bps_tf/" + suffix))


def test_without_bazel_the_test_fails_and_says_how_to_install_it(monkeypatch):
    # Nothing is installed behind the user's back, and nothing is skipped.
    monkeypatch.setattr(sys.modules[__name__], "DEBIAN_PACKAGES",
                        {"bazel-bootstrap": "no-such-bazel", "bazel-rules-java": "/no/such/path"})
    with pytest.raises(pytest.fail.Exception) as failed:
        _require_bazel()
    assert str(failed.value) == (
        "the Bazel build cannot be tested: Debian's bazel-bootstrap and bazel-rules-java are not "
        "installed. Install them first, as root, as the README's test instructions say: "
        "apt-get update && apt-get install -y bazel-bootstrap bazel-rules-java")
