"""Suite-wide set-up: the op library exists before any timed test starts.

After `pip install .` with build isolation the op library is compiled at
first import (bps_tf/runtime/op_build.py). Doing that once here keeps the compile
out of tests that bound their processes' start-up time.
"""
import importlib.util
import os
import subprocess
import sys
import tempfile

BUILD_TIMEOUT_S = 900


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
        proc = subprocess.run([sys.executable, "-m", "bps_tf.runtime.op_build"], env=env,
                              cwd=tempfile.gettempdir(), capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"bps_tf's op library did not build in {BUILD_TIMEOUT_S} s")
    if proc.returncode != 0:
        raise SystemExit("bps_tf's op library cannot be built or loaded:\n"
                         + (proc.stdout + proc.stderr)[-4000:])
