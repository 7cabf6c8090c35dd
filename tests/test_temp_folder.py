"""The suite leaves nothing in the temporary folder, pytest's own folders included.

A session with tests/session_temp.py (the plugin tests/conftest.py uses) in
a temporary folder of its own: its tests write into ``tmp_path`` and
``tmp_path_factory``, and when it ends the folder is empty. Without the
plugin, pytest keeps its base folder there (pytest-of-<user>/pytest-N):
the check would see it.
"""
import os
import subprocess
import sys
import textwrap

TESTS = os.path.dirname(os.path.abspath(__file__))

INNER = textwrap.dedent('''
    import os

    def test_writes_where_pytest_says(tmp_path, tmp_path_factory):
        (tmp_path / "big").write_bytes(b"x" * (4 << 20))
        (tmp_path_factory.mktemp("shared") / "f").write_text("y")
        print("tmp_path", tmp_path, "TMPDIR", os.environ["TMPDIR"])
''')


def _inner_session(folder, plugin):
    os.makedirs(folder)
    tests = folder / "inner"
    tests.mkdir()
    (tests / "test_inner.py").write_text(INNER)
    env = dict(os.environ, TMPDIR=str(folder), PYTHONPATH=TESTS)
    env.pop("PYTEST_DEBUG_TEMPROOT", None)
    args = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
            str(tests / "test_inner.py")]
    if plugin:
        args[3:3] = ["-p", "session_temp"]
    proc = subprocess.run(args, cwd=str(tests), env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (tests / "test_inner.py").unlink()
    tests.rmdir()
    return proc.stdout, sorted(os.listdir(folder))


def test_the_suite_keeps_pytests_folders_inside_its_own_and_removes_them(tmp_path):
    out, left = _inner_session(tmp_path / "with_plugin", plugin=True)
    assert left == [], out
    # Its tmp_path was inside the session's own folder, inside this one.
    words = out.split()
    inner_tmp, inner_private = words[words.index("tmp_path") + 1], words[words.index("TMPDIR") + 1]
    assert inner_private.startswith(str(tmp_path / "with_plugin" / "bps_tests_")), out
    assert inner_tmp.startswith(os.path.join(inner_private, "pytest") + os.sep), out
    # The control: pytest alone leaves its base folder behind.
    _, left = _inner_session(tmp_path / "without", plugin=False)
    assert [name for name in left if name.startswith("pytest-of-")], left


def test_this_sessions_tmp_path_is_inside_its_own_folder(tmp_path):
    private = os.environ["TMPDIR"]
    assert os.path.basename(private).startswith("bps_tests_")
    assert str(tmp_path).startswith(os.path.join(private, "pytest") + os.sep)
