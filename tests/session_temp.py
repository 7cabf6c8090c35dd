"""The suite's temporary folder: one of the session's own, checked and removed at the end.

The tests and every process they start (TMPDIR) use a temporary folder of
this session's own, so what they leave there is theirs alone, even while
other test sessions share the machine: at the end the session fails if
anything is left in it (each creator must remove what it makes), and then
removes it. pytest's own base folder (``tmp_path``, ``tmp_path_factory``) is
made inside it too, unless --basetemp names one, and goes with it: the suite
leaves nothing behind (pytest's default, pytest-of-<user>/pytest-N in the
system's temporary folder, keeps the last three runs, 16 MB each).

A pytest plugin: tests/conftest.py takes its hooks, and
tests/test_temp_folder.py runs a session with it alone (``-p session_temp``).
"""
import os
import shutil
import sys
import tempfile

import pytest

PYTEST_BASETEMP = "pytest"    # pytest's base folder, inside the session's own
_session_tmp = {}


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if hasattr(config, "workerinput"):
        # A pytest-xdist worker (`pytest -n 2`): the controlling session made
        # the folder (TMPDIR, inherited) and pytest's base folder in it, and
        # checks and removes both when every worker is done.
        return
    real = tempfile.gettempdir()
    # Caches a test keeps between runs on purpose (Bazel's output root).
    os.environ.setdefault("BPS_TEST_CACHE_TMPDIR", real)
    private = tempfile.mkdtemp(prefix="bps_tests_", dir=real)
    _session_tmp.update(path=private, before=(os.environ.get("TMPDIR"), tempfile.tempdir))
    if config.option.basetemp is None:
        # Read by pytest's tmpdir plugin when it configures, after this hook.
        config.option.basetemp = os.path.join(private, PYTEST_BASETEMP)
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
    # tempfile's bare default names. The folder removal below takes them, and
    # pytest's base folder. Every temporary name of bps_tf and of its tests
    # has a prefix of its own, so anything else is a leak of ours.
    names = sorted(os.listdir(private)) if os.path.isdir(private) else []
    left = [name for name in names if not _library_temp_name(name) and name != PYTEST_BASETEMP]
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
