"""The gRPC health service (grpc.health.v1) of servers, probed with a gRPC client.

A real server 0 (hosting the scheduler) waits for one numpy worker: before the
worker joins it reports NOT_SERVING (the cluster has not met; nothing else can
make it meet), once the worker joined SERVING, and after the worker is killed
(a lost peer) NOT_SERVING, or its port is closed because it already exited.
Ports come from the OS; every process is killed at the end.
"""
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

pytest.importorskip("grpc_health.v1.health")
import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from bps_tf import health, launcher  # noqa: E402

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
GONE = "port closed"

WORKER = r'''
import os, sys, time
from bps_tf import basics
basics.init()
print("JOINED", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
basics.shutdown()
'''


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check(port, service=""):
    """The status the server reports for ``service``, or GONE if nothing answers."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=3)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return GONE
            raise
        return reply.status


def wait_for(what, predicate, within=30.0):
    give_up = time.monotonic() + within
    while True:
        value = what()
        if predicate(value):
            return value
        assert time.monotonic() < give_up, f"still {value!r} after {within} s"
        time.sleep(0.1)


# ---------------------------------------------------------------- unit level

def test_statuses_follow_the_core_state():
    assert health.statuses_for(health.STARTING) == {
        "": False, health.SERVICE_CLUSTER: False, health.SERVICE_LIVE: True}
    assert health.statuses_for(health.MET) == {
        "": True, health.SERVICE_CLUSTER: True, health.SERVICE_LIVE: True}
    assert health.statuses_for(health.ENDING)[""] is False
    assert health.statuses_for(health.FAILED) == {
        "": False, health.SERVICE_CLUSTER: False, health.SERVICE_LIVE: False}


def test_health_server_follows_a_state_and_rejects_a_taken_port():
    state = {"now": health.STARTING}
    server = health.HealthServer("127.0.0.1", 0, lambda: state["now"], poll_interval_s=0.05)
    port = server.start()
    try:
        assert check(port) == NOT_SERVING and check(port, health.SERVICE_LIVE) == SERVING
        state["now"] = health.MET
        wait_for(lambda: check(port), lambda s: s == SERVING, within=5)
        assert check(port, health.SERVICE_CLUSTER) == SERVING
        state["now"] = health.FAILED
        wait_for(lambda: check(port, health.SERVICE_LIVE), lambda s: s == NOT_SERVING, within=5)
        assert check(port) == NOT_SERVING
        with pytest.raises(health.HealthError, match="cannot serve the gRPC health service"):
            health.HealthServer("127.0.0.1", port, lambda: 0).start()
    finally:
        server.stop(failed=True)
    assert check(port) == GONE


# ---------------------------------------------------------------- a live server

@pytest.fixture
def cluster(tmp_path):
    """Starts processes for one job and kills whatever is left at the end."""
    procs = []
    base = {k: v for k, v in os.environ.items() if k not in launcher.PLACEMENT_VARIABLES}
    base.update({"DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
                 "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_NODE_HOST": "127.0.0.1",
                 "BYTEPS_BIND_HOST": "127.0.0.1", "BYTEPS_JOB_TOKEN": secrets.token_hex(16),
                 "BYTEPS_HEARTBEAT_INTERVAL": "0.2", "BYTEPS_TIMEOUT": "2"})

    def start(argv, **env):
        log = open(tmp_path / f"p{len(procs)}.log", "w+")
        proc = subprocess.Popen(argv, env=dict(base, **env), stdout=log, stderr=subprocess.STDOUT,
                                cwd=tempfile.gettempdir(), start_new_session=True)
        procs.append((proc, log))
        return proc

    def logs():
        text = []
        for proc, log in procs:
            log.seek(0)
            text.append(f"--- pid {proc.pid} rc {proc.poll()}\n{log.read()[-2000:]}")
        return "\n".join(text)

    start.logs = logs
    yield start
    for proc, log in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def test_a_live_server_reports_the_cluster_meeting_and_a_lost_peer(cluster, tmp_path):
    port = free_port()
    ready = tmp_path / "scheduler.port"
    server = cluster([sys.executable, "-m", "bps_tf.server"], DMLC_ROLE="server",
                     BYTEPS_SERVER_ID="0", BYTEPS_HOST_SCHEDULER="1", DMLC_PS_ROOT_PORT="0",
                     BYTEPS_SERVER_PORT="0", BYTEPS_READY_FILE=str(ready),
                     BYTEPS_HEALTH_PORT=str(port))
    wait_for(lambda: ready.exists() or server.poll() is not None, bool)
    assert server.poll() is None, cluster.logs()
    # The health service starts before the core listens: it answers now, and
    # the cluster cannot have met, for no worker exists yet.
    assert check(port) == NOT_SERVING, cluster.logs()
    assert check(port, health.SERVICE_CLUSTER) == NOT_SERVING
    assert check(port, health.SERVICE_LIVE) == SERVING

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    worker = cluster([sys.executable, str(script), str(tmp_path / "never")], DMLC_ROLE="worker",
                     DMLC_WORKER_ID="0", DMLC_PS_ROOT_PORT=ready.read_text().strip())
    wait_for(lambda: check(port), lambda s: s == SERVING)
    assert check(port, health.SERVICE_LIVE) == SERVING

    os.killpg(worker.pid, signal.SIGKILL)    # a lost peer: no more heartbeats
    wait_for(lambda: check(port), lambda s: s in (NOT_SERVING, GONE))
    assert check(port, health.SERVICE_LIVE) in (NOT_SERVING, GONE)
    assert server.wait(timeout=30) == 1, cluster.logs()
    assert check(port) == GONE


def test_a_finished_job_closes_the_health_port(cluster, tmp_path):
    port = free_port()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    (tmp_path / "go").touch()
    # Through bpslaunch: its --health-port reaches the one server.
    proc = subprocess.run([sys.executable, "-m", "bps_tf.launcher", "-np", "1", "--servers", "1",
                           "--health-port", str(port), "--timeout", "60", sys.executable,
                           str(script), str(tmp_path / "go")],
                          capture_output=True, text=True, timeout=90, cwd=tempfile.gettempdir(),
                          env={k: v for k, v in os.environ.items()
                               if k not in launcher.PLACEMENT_VARIABLES})
    assert proc.returncode == 0, proc.stderr
    assert f"gRPC health on port {port}" in proc.stderr.splitlines()[0]
    assert "[worker 0] JOINED" in proc.stdout
    assert check(port) == GONE
