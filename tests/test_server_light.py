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
    from bps_tf import launcher
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
