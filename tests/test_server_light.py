"""Servers are cheap CPU processes: they must never import TensorFlow."""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from manual_cluster import ROOT  # noqa: E402

PROBE = ("import sys\n"
         "from bps_tf import server\n"
         "code = server.main()\n"
         "print('TENSORFLOW_IMPORTED=%s' % ('tensorflow' in sys.modules), flush=True)\n"
         "sys.exit(code)\n")


def test_server_serves_a_tensorflow_worker_without_importing_tensorflow():
    from bps_tf.launch import launcher
    worker = [sys.executable, os.path.join(ROOT, "tests", "workers", "tf_one_op.py")]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    # The launcher's server command is injectable: wrap the real server in a
    # probe that reports, after serving the job, whether TensorFlow loaded.
    # `python -c` puts the working directory on sys.path: run from a neutral
    # one so the installed package is what the server imports.
    old_out, old_cwd = os.dup(1), os.getcwd()
    os.dup2(log.fileno(), 1)
    os.chdir(tempfile.gettempdir())
    try:
        code = launcher.run_local(1, 1, worker, server_command=[sys.executable, "-c", PROBE])
    finally:
        os.chdir(old_cwd)
        os.dup2(old_out, 1)
        os.close(old_out)
    with open(log.name) as f:
        text = f.read()
    os.unlink(log.name)
    assert code == 0, text
    assert "TENSORFLOW_IMPORTED=False" in text, text
    assert "TENSORFLOW_IMPORTED=True" not in text


def test_servers_ignore_a_bps_tf_checkout_in_the_working_directory(tmp_path, monkeypatch):
    """bpslaunch is often run from a source checkout whose bps_tf has no built
    libraries; the servers it starts must still import the installed one."""
    from bps_tf.launch import launcher
    decoy = tmp_path / "bps_tf"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the decoy checkout was imported')\n")
    worker = [sys.executable, os.path.join(ROOT, "tests", "workers", "robust_worker.py"),
              "exact", str(tmp_path), "20"]
    monkeypatch.setenv("BYTEPS_PARTITION_BYTES", "65536")
    old_cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code = launcher.run_local(2, 1, worker)
    finally:
        os.chdir(old_cwd)
    assert code == 0
    assert (tmp_path / "rank0.json").exists() and (tmp_path / "rank1.json").exists()


def test_starting_a_node_imports_no_process_or_file_tools():
    """A job of a few hundred processes starts each of them: importing bps_tf
    and loading the core stay free of what only a fallback needs
    (ctypes.util's library search imports subprocess and tempfile, ~10 ms a
    process, and runs subprocesses when called)."""
    code = ("import sys\n"
            "import bps_tf\n"
            "from bps_tf.runtime import basics, elastic_core, loader, server\n"
            "loader.load_core()\n"
            "print(' '.join(m for m in ('subprocess', 'ctypes.util', 'tempfile', 'tensorflow')\n"
            "               if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tempfile.gettempdir(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [], out.stdout
