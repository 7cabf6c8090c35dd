"""Protected mode: a node reachable from other hosts needs a job token.

A hand-started cluster (TF_CONFIG or DMLC_*) whose addresses are not all
loopback ones must not run open: a server that would listen on every
address, or a worker meeting a scheduler on another host, refuses to start
without BYTEPS_JOB_TOKEN and says how to set one, unless
BYTEPS_ALLOW_INSECURE=1 (a loud warning). A cluster on one machine binds
loopback by itself and needs nothing. Servers import no TensorFlow, so
these run in a fraction of a second each.
"""
import json
import logging
import os
import socket
import shlex
import subprocess
import sys
import tempfile
import time

import pytest

from bps_tf.runtime import cluster, security

# TEST-NET-1 (RFC 5737): never routed. Only named in the spec, never a
# target: the server below listens and waits; nothing connects to it.
REMOTE = "192.0.2.10"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tf_config(host, port, task=("ps", 0)):
    return json.dumps({"cluster": {"chief": [f"{host}:{port + 1}"], "ps": [f"{host}:{port}"]},
                       "task": {"type": task[0], "index": task[1]}})


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_")) and k != "TF_CONFIG"}
    env.update(extra)
    return env


def test_a_cluster_on_loopback_binds_loopback_and_needs_no_token():
    spec = cluster.resolve({"TF_CONFIG": _tf_config("127.0.0.1", 4000)})
    assert spec.bind_host == "127.0.0.1"
    assert security.exposure(spec) == ""
    security.refuse_unprotected(spec, "", False, logging.getLogger("bps_tf"))   # no error


def test_a_cluster_across_hosts_binds_every_address():
    spec = cluster.resolve({"TF_CONFIG": _tf_config(REMOTE, 4000)})
    assert spec.bind_host == "0.0.0.0"
    assert "listen on every address of this host" in security.exposure(spec)
    worker = cluster.resolve({"TF_CONFIG": _tf_config(REMOTE, 4000, ("chief", 0))})
    assert "connect to the scheduler at 192.0.2.10" in security.exposure(worker)
    explicit = cluster.resolve({"TF_CONFIG": _tf_config(REMOTE, 4000),
                                "BYTEPS_BIND_HOST": "127.0.0.1"})
    assert explicit.bind_host == "127.0.0.1"


def test_a_worker_without_a_token_refuses_with_the_fix():
    spec = cluster.resolve({"TF_CONFIG": _tf_config(REMOTE, 4000, ("chief", 0))})
    with pytest.raises(security.InsecureClusterError) as info:
        security.refuse_unprotected(spec, "", False, logging.getLogger("bps_tf"))
    message = str(info.value)
    assert "refusing to start without a job token" in message
    assert "BYTEPS_JOB_TOKEN" in message and "every node" in message
    assert "BYTEPS_ALLOW_INSECURE=1" in message and "from TF_CONFIG" in message
    security.refuse_unprotected(spec, "a-job-token-of-24-chars", False, logging.getLogger("bps_tf"))


def test_a_server_on_the_network_without_a_token_refuses_to_start():
    port = _free_port()
    proc = subprocess.run([sys.executable, "-m", "bps_tf.server"], cwd=tempfile.gettempdir(),
                          env=_env(TF_CONFIG=_tf_config(REMOTE, port)), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "refusing to start without a job token" in proc.stderr
    assert "would listen on every address of this host" in proc.stderr


def test_the_opt_out_starts_with_a_loud_warning():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bps_tf.server"], cwd=tempfile.gettempdir(),
                            env=_env(TF_CONFIG=_tf_config(REMOTE, port),
                                     BYTEPS_ALLOW_INSECURE="1", BYTEPS_RENDEZVOUS_TIMEOUT="30"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Started: it listens on its port and waits for the workers.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[1]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "BYTEPS_ALLOW_INSECURE=1" in err and "NO job token" in err, err


REFUSAL = "bps_tf worker: refusing to start without a job token: this node would connect to " \
          "the scheduler at 192.0.2.10 over the network (from TF_CONFIG)"


@pytest.mark.parametrize("joins", ["bps_tf.init()", "bps_tf.BytePSStrategy()"])
def test_a_worker_without_a_token_refuses_before_tensorflow_loads(joins):
    # Like the server: one line, exit code 2, no traceback; and before the
    # seconds TensorFlow takes to load (BytePSStrategy would import it).
    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('tensorflow loaded:', 'tensorflow' in sys.modules))\n"
            f"import bps_tf\n{joins}\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tempfile.gettempdir(),
                          env=_env(TF_CONFIG=_tf_config(REMOTE, 4000, ("chief", 0))),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(REFUSAL), proc.stderr
    assert proc.stdout.strip() == "tensorflow loaded: False"


@pytest.mark.parametrize("task", [("chief", 0), ("ps", 0)])
def test_bpslaunch_refuses_before_starting_anything(task, tmp_path):
    marker = tmp_path / "started"
    proc = subprocess.run([sys.executable, "-m", "bps_tf.launch", sys.executable, "-c",
                           f"open({str(marker)!r}, 'w').close()"], cwd=tempfile.gettempdir(),
                          env=_env(TF_CONFIG=_tf_config(REMOTE, 4000, task)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    role = "worker" if task[0] == "chief" else "server"
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"bpslaunch: bps_tf {role}: refusing to start without a job "
                               "token"), proc.stderr
    assert not marker.exists()


@pytest.mark.parametrize("token, why", [
    ("s3cr3t", "it is 6 bytes long (at least 16)"),
    ("t" * 32, "it uses 1 different characters (at least 8)"),
    ("passwordpassword", "it uses 7 different characters (at least 8)"),
    ("1234567890123456", "it holds about 53 bits of entropy (at least 64)"),
])
def test_a_weak_token_is_refused_off_loopback_with_the_way_to_make_one(token, why, caplog):
    worker = cluster.resolve({"TF_CONFIG": _tf_config(REMOTE, 4000, ("chief", 0))})
    log = logging.getLogger("bps_tf")
    with pytest.raises(security.InsecureClusterError) as info:
        security.refuse_unprotected(worker, token, False, log)
    message = str(info.value)
    assert "refusing a weak BYTEPS_JOB_TOKEN" in message and why in message, message
    assert security.MAKE_TOKEN in message and "BYTEPS_ALLOW_INSECURE=1" in message
    # The command it names prints a token that passes.
    # (quoted: a clone's folder may have a space in its name)
    command = security.MAKE_TOKEN.replace("python", shlex.quote(sys.executable), 1)
    made = subprocess.run(command, shell=True, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert len(made) >= 16 and security.token_weakness(made) == ""
    security.refuse_unprotected(worker, made, False, log)
    # On loopback the token only keeps jobs apart; a trusted network opts out.
    local = cluster.resolve({"TF_CONFIG": _tf_config("127.0.0.1", 4000, ("chief", 0))})
    security.refuse_unprotected(local, token, False, log)
    with caplog.at_level(logging.WARNING, logger="bps_tf"):
        security.refuse_unprotected(worker, token, True, log)
    assert any("weak job token" in r.getMessage() for r in caplog.records)


def test_a_server_on_the_network_with_a_weak_token_refuses_to_start():
    proc = subprocess.run([sys.executable, "-m", "bps_tf.server"], cwd=tempfile.gettempdir(),
                          env=_env(TF_CONFIG=_tf_config(REMOTE, _free_port()),
                                   BYTEPS_JOB_TOKEN="short"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "refusing a weak BYTEPS_JOB_TOKEN" in proc.stderr, proc.stderr
    assert "secrets.token_hex(16)" in proc.stderr, proc.stderr
