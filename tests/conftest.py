"""Suite-wide set-up: the op library exists before any timed test starts,
and the suite leaves nothing in the temporary folder.

After `pip install .` with build isolation the op library is compiled at
first import (bps_tf/ops/op_build.py). Doing that once here keeps the compile
out of tests that bound their processes' start-up time.

The tests and every process they start (TMPDIR) use a temporary folder of
this session's own, so what they leave there is theirs alone, even while
other test sessions share the machine: at the end the session fails if
anything is left in it (each creator must remove what it makes), and then
removes it. pytest's own `tmp_path` folders stay where pytest keeps them.

A suite started in the background of a non-interactive shell (`pytest &`)
inherits SIGINT ignored, and every process it starts would too: the tests
that press Ctrl-C on a worker or a build need the default, so the session
takes it back.
"""
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile

BUILD_TIMEOUT_S = 900
_session_tmp = {}


def pytest_configure(config):
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # A handler, unlike SIG_IGN, is not inherited: children start with
        # the default, and Python turns that into KeyboardInterrupt.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    real = tempfile.gettempdir()
    # Before pytest first asks for its base folder, which it derives from it.
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", real)
    # Caches a test keeps between runs on purpose (Bazel's output root).
    os.environ.setdefault("BPS_TEST_CACHE_TMPDIR", real)
    private = tempfile.mkdtemp(prefix="bps_tests_", dir=real)
    _session_tmp.update(path=private, before=(os.environ.get("TMPDIR"), tempfile.tempdir))
    os.environ["TMPDIR"] = private
    tempfile.tempdir = private


def _library_temp_name(name):
    if name.startswith("__autograph_generated_file") and name.endswith(".py"):
        return True
    # tempfile's default: "tmp" and 8 characters of its alphabet.
    return (len(name) == 11 and name.startswith("tmp") and
            all(c in "abcdefghijklmnopqrstuvwxyz0123456789_" for c in name[3:]))


def pytest_sessionfinish(session, exitstatus):
    private = _session_tmp.get("path")
    if not private:
        return
    # Libraries' own temporary names: TensorFlow's autograph writes a source
    # file per converted function and removes it at interpreter exit, which a
    # worker the test kills on purpose (SIGKILL, os._exit in the crash
    # checks) never reaches; Keras' and TensorFlow's savers make folders with
    # tempfile's bare default names. The folder removal below takes them.
    # Every temporary name of bps_tf and of its tests has a prefix of its own,
    # so anything else is a leak of ours.
    names = sorted(os.listdir(private)) if os.path.isdir(private) else []
    left = [name for name in names if not _library_temp_name(name)]
    shutil.rmtree(private, ignore_errors=True)
    previous, tempfile.tempdir = _session_tmp["before"]
    if previous is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = previous
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        text = ("the tests left these in the temporary folder (removed now; the test or "
                "worker that makes each must remove it): " + ", ".join(left))
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(text, red=True)
        else:
            print(text, file=sys.stderr)
        session.exitstatus = 1


def pytest_sessionstart(session):
    if importlib.util.find_spec("tensorflow") is None:
        # Nothing to build against. The TensorFlow-free tests (the core, the
        # servers, tests/test_gpu.py on a GPU machine) still run; the others
        # fail on their own import of TensorFlow.
        print("bps_tf tests: TensorFlow is not installed; only TensorFlow-free tests can pass")
        return
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("DMLC_")}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        proc = subprocess.run([sys.executable, "-m", "bps_tf.op_build"], env=env,
                              cwd=tempfile.gettempdir(), capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"bps_tf's op library did not build in {BUILD_TIMEOUT_S} s")
    if proc.returncode != 0:
        raise SystemExit("bps_tf's op library cannot be built or loaded:\n"
                         + (proc.stdout + proc.stderr)[-4000:])
