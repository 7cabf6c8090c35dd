"""Suite-wide set-up: the op library exists before any timed test starts,
and the suite leaves nothing in the temporary folder.

After `pip install .` with build isolation the op library is compiled at
first import (bps_tf/ops/op_build.py). Doing that once here keeps the compile
out of tests that bound their processes' start-up time.

The tests, every process they start and pytest's own `tmp_path` folders use
a temporary folder of this session's own, which is checked and removed at
the end (tests/session_temp.py).

A suite started in the background of a non-interactive shell (`pytest &`)
inherits SIGINT ignored, and every process it starts would too: the tests
that press Ctrl-C on a worker or a build need the default, so the session
takes it back.
"""
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile

import pytest

# The suite's temporary folder (tests/ is on sys.path: conftest's folder).
from session_temp import pytest_configure as _temp_folder_configure
from session_temp import pytest_sessionfinish  # noqa: F401  (a hook)

BUILD_TIMEOUT_S = 900

# The files that take longest (measured alone on 2 cores: 245 s, 195 s, 185 s cold, ...) first:
# with `pytest -n 2` the two pytest workers then finish near each other, instead
# of one waiting alone on a long file handed out last. The others keep their order.
LONGEST_FIRST = ("test_overlap_fit.py", "test_strategy.py", "test_bazel.py", "test_op_build.py",
                 "test_tf_keras.py", "test_robustness.py", "test_elastic_fit.py",
                 "test_k8s_jobs.py", "test_elastic.py", "test_tf_multiworker.py",
                 "test_hook_renames.py", "test_overlap.py")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # A handler, unlike SIG_IGN, is not inherited: children start with
        # the default, and Python turns that into KeyboardInterrupt.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _temp_folder_configure(config)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable


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
