"""The op library is compiled against the TensorFlow that loads it, once.

Each check runs on a copy of the installed package without its op library
(as after `pip install .` with build isolation, or after a TensorFlow
upgrade), with its own empty cache directory.
"""
import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

import bps_tf
from bps_tf.op_build import load_builder

op_build = load_builder()

BUILD_TIMEOUT_S = 900
PROBE = textwrap.dedent("""
    import json, sys
    import tensorflow as tf
    import bps_tf
    from bps_tf import ops
    bps_tf.init()
    out = ops.push_pull_sum(tf.constant([1.0, 2.5]), "op_build_probe")
    loaded = [l.split(maxsplit=5)[5].strip() for l in open("/proc/self/maps")
              if l.rstrip().endswith("libbps_tf_ops.so")]
    print(json.dumps({"sum": out.numpy().tolist(), "loaded": sorted(set(loaded))}))
""")


def _stage(root):
    """A copy of the installed package with no op library in it."""
    installed = os.path.dirname(os.path.abspath(bps_tf.__file__))
    stage = os.path.join(root, "site")
    shutil.copytree(installed, os.path.join(stage, "bps_tf"),
                    ignore=shutil.ignore_patterns("__pycache__", op_build.LIBRARY_NAME + "*"))
    return stage


def _start(stage, cache, **env_extra):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("DMLC_")}
    env.update(PYTHONPATH=stage, BPS_TF_CACHE_DIR=cache, TF_CPP_MIN_LOG_LEVEL="2")
    env.update(env_extra)
    return subprocess.Popen([sys.executable, "-c", PROBE], cwd=stage, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc):
    out, err = proc.communicate(timeout=BUILD_TIMEOUT_S)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def built():
    """Two processes start together with an empty cache: one builds, both load it."""
    root = tempfile.mkdtemp(prefix="bps_op_build ")  # a space in the path, on purpose
    stage, cache = _stage(root), os.path.join(root, "cache dir")
    procs = [_start(stage, cache) for _ in range(2)]
    results = [_finish(p) for p in procs]
    yield stage, cache, results
    shutil.rmtree(root, ignore_errors=True)


def test_a_missing_op_library_is_built_once_for_concurrent_workers(built):
    stage, cache, results = built
    for rc, out, err in results:
        assert rc == 0, err[-3000:]
        seen = json.loads(out.strip().splitlines()[-1])
        assert seen["sum"] == [1.0, 2.5]
        assert len(seen["loaded"]) == 1 and seen["loaded"][0].startswith(cache), seen
    messages = [err.count("compiling it for TensorFlow") for _, _, err in results]
    assert sorted(messages) == [0, 1], [e[-2000:] for _, _, e in results]
    assert "was not built at install" in "".join(err for _, _, err in results)


def test_a_stale_installed_library_is_never_loaded(built):
    stage, cache, _ = built
    # An op library "from another TensorFlow" sits where the installed one goes.
    (lib,) = [os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs
              if f == op_build.LIBRARY_NAME]
    installed = os.path.join(stage, "bps_tf", "ops", op_build.LIBRARY_NAME)
    shutil.copy(lib, installed)
    op_build.write_stamp(installed, "0" * 20, "2.0.0")
    try:
        rc, out, err = _finish(_start(stage, cache))
        assert rc == 0, err[-3000:]
        seen = json.loads(out.strip().splitlines()[-1])
        assert seen["loaded"] == [lib] and seen["sum"] == [1.0, 2.5]
        assert "compiling" not in err  # the cache already holds this TensorFlow's build
        # Once stamped for this TensorFlow, the installed library is the one used.
        stamp = subprocess.run([sys.executable, "-m", "bps_tf.op_build", "--stamp", installed],
                               cwd=stage, env=dict(os.environ, PYTHONPATH=stage,
                                                   TF_CPP_MIN_LOG_LEVEL="2"),
                               capture_output=True, text=True, timeout=300)
        assert stamp.returncode == 0, stamp.stderr
        rc, out, err = _finish(_start(stage, cache))
        assert rc == 0 and json.loads(out.strip().splitlines()[-1])["loaded"] == [installed]
    finally:
        for path in (installed, installed + op_build.STAMP_SUFFIX):
            if os.path.exists(path):
                os.remove(path)


def test_no_compiler_is_a_clear_error(tmp_path):
    stage = _stage(str(tmp_path))
    rc, out, err = _finish(_start(stage, str(tmp_path / "empty-cache"),
                                  CXX="/nonexistent/g++"))
    assert rc != 0
    assert "C++ compiler '/nonexistent/g++' was not found" in err, err[-3000:]
    assert "install g++" in err


def _info(root):
    return {"version": "2.21.0", "root": root,
            "cflags": [f"-I{root}/include", "-D_GLIBCXX_USE_CXX11_ABI=1", "--std=c++17"],
            "lflags": [f"-L{root}", "-l:libtensorflow_framework.so.2"]}


def test_the_key_is_what_changes_the_binary_not_where_things_are_installed():
    key = op_build.build_key(_info("/venv-a/lib/python3.11/site-packages/tensorflow"))
    assert op_build.build_key(_info("/srv/b/lib/python3.12/site-packages/tensorflow")) == key
    # Without the folder given, the one in TensorFlow's include flag is the one.
    found = {k: v for k, v in _info("/x/site-packages/tensorflow").items() if k != "root"}
    assert op_build.build_key(found) == key
    assert op_build.build_key(dict(_info("/a/tensorflow"), version="2.20.0")) != key
    abi = _info("/a/tensorflow")
    abi["cflags"][1] = "-D_GLIBCXX_USE_CXX11_ABI=0"
    assert op_build.build_key(abi) != key


def test_another_environment_with_the_same_tensorflow_reuses_the_build(built, tmp_path):
    """TensorFlow reached through another path (as from another virtual
    environment), bps_tf from another folder: the cached library loads, and
    nothing is compiled."""
    stage, cache, _ = built
    import tensorflow
    site = os.path.dirname(os.path.dirname(os.path.abspath(tensorflow.__file__)))
    alias = tmp_path / "other-venv-site"
    alias.symlink_to(site, target_is_directory=True)
    other = _stage(str(tmp_path))
    rc, out, err = _finish(_start(other, cache, PYTHONPATH=f"{other}:{alias}"))
    assert rc == 0, err[-3000:]
    assert "compiling" not in err, err[-3000:]
    seen = json.loads(out.strip().splitlines()[-1])
    assert len(seen["loaded"]) == 1 and seen["loaded"][0].startswith(cache), seen


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_build_leaves_no_folder_and_no_compiler(tmp_path, signum):
    """Ctrl-C (or SIGTERM) while the op library compiles: the process ends
    as the signal says, its temporary build folder is gone, and none of the
    compilers it started is left running or a zombie."""
    psutil = pytest.importorskip("psutil")
    stage, cache = _stage(str(tmp_path)), str(tmp_path / "cache")
    proc = _start(stage, cache)
    deadline = time.time() + 120
    compilers = []
    while not compilers:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
        with contextlib.suppress(psutil.Error):
            tree = psutil.Process(proc.pid).children(recursive=True)
            compilers = [p for p in tree if p.name() in ("cc1plus", "as")]
    started = psutil.Process(proc.pid).children(recursive=True)
    assert glob.glob(os.path.join(cache, "*", op_build.BUILD_DIR_PREFIX + "*"))
    proc.send_signal(signum)
    rc, _, err = _finish(proc)
    assert rc == -signum, err[-3000:]   # Python ends an uncaught Ctrl-C by SIGINT too
    if signum == signal.SIGINT:
        assert "KeyboardInterrupt" in err, err[-3000:]
    assert not glob.glob(os.path.join(cache, "*", op_build.BUILD_DIR_PREFIX + "*"))
    time.sleep(0.5)   # an orphan would still run, a zombie stay listed
    left = []
    for p in started:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running():   # the same process (pid and start time), live or zombie
                left.append((p.pid, p.name(), p.status()))
    assert not left, left
