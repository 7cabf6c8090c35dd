"""The gRPC health service (grpc.health.v1) of servers, probed with a gRPC client.

A real server 0 (hosting the scheduler) waits for one numpy worker: before the
worker joins it reports NOT_SERVING (the cluster has not met; nothing else can
make it meet), once the worker joined SERVING, and after the worker is killed
(a lost peer) NOT_SERVING, or its port is closed because it already exited.
Ports come from the OS; every process is killed at the end.

gRPC runs only in child processes: a process that has loaded gRPC's event
engine must not fork (later tests fork from the pytest process).
"""
import importlib.util
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from bps_tf.runtime import health
from bps_tf.launch import environments

# Looked up, not imported: see above.
if importlib.util.find_spec("grpc_health") is None:
    pytest.skip("grpcio-health-checking is not installed", allow_module_level=True)

GONE = "GONE"

# Asks Check(service) until the answer is one of the wanted ones (or once).
PROBE = r"""
import sys, time, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
port, service, wanted, within = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
names = health_pb2.HealthCheckResponse.ServingStatus
give_up = time.monotonic() + within
while True:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=3)
            status = names.Name(reply.status)
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            status = "GONE"
    if not wanted or status in wanted.split(",") or time.monotonic() > give_up:
        print(status, flush=True)
        break
    time.sleep(0.1)
"""

WORKER = r'''
import os, sys, time
import bps_tf
from bps_tf.runtime import basics
bps_tf.init()
print("JOINED", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
basics.shutdown()
'''


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check(port, service="", until=(), within=30.0):
    """What the server reports for ``service`` (SERVING, NOT_SERVING, or GONE when
    nothing answers); with ``until``, the first answer among those, or the last."""
    proc = subprocess.run([sys.executable, "-c", PROBE, str(port), service, ",".join(until),
                           str(within)], capture_output=True, text=True, timeout=within + 30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def wait_for(predicate, within=30.0):
    give_up = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < give_up, f"not true after {within} s"
        time.sleep(0.05)


# ---------------------------------------------------------------- unit level

def test_statuses_follow_the_core_state():
    assert health.statuses_for(health.STARTING) == {
        "": False, health.SERVICE_CLUSTER: False, health.SERVICE_LIVE: True}
    assert health.statuses_for(health.MET) == {
        "": True, health.SERVICE_CLUSTER: True, health.SERVICE_LIVE: True}
    assert health.statuses_for(health.ENDING)[""] is False
    assert health.statuses_for(health.FAILED) == {
        "": False, health.SERVICE_CLUSTER: False, health.SERVICE_LIVE: False}


FOLLOW = r"""
import os, sys, time
from bps_tf.runtime import health
path = sys.argv[1]
def state():
    with open(path) as f:
        return int(f.read() or 0)
server = health.HealthServer("127.0.0.1", 0, state, poll_interval_s=0.05)
print(server.start(), flush=True)
try:
    health.HealthServer("127.0.0.1", server.port, state).start()
except health.HealthError as exc:
    print("TAKEN", exc, flush=True)
sys.stdin.readline()
server.stop(failed=True)
"""


def test_health_server_follows_a_state_and_rejects_a_taken_port(tmp_path):
    state = tmp_path / "state"
    state.write_text(str(health.STARTING))
    proc = subprocess.Popen([sys.executable, "-c", FOLLOW, str(state)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        assert "cannot serve the gRPC health service" in proc.stdout.readline()
        assert check(port) == "NOT_SERVING"
        assert check(port, health.SERVICE_LIVE) == "SERVING"
        state.write_text(str(health.MET))
        assert check(port, until=["SERVING"], within=5) == "SERVING"
        assert check(port, health.SERVICE_CLUSTER) == "SERVING"
        state.write_text(str(health.FAILED))
        assert check(port, health.SERVICE_LIVE, until=["NOT_SERVING"], within=5) == "NOT_SERVING"
        assert check(port) == "NOT_SERVING"
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=10) == 0
        assert check(port) == GONE
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- a live server

@pytest.fixture
def cluster(tmp_path):
    """Starts processes for one job and kills whatever is left at the end."""
    procs = []
    base = {k: v for k, v in os.environ.items() if k not in environments.PLACEMENT_VARIABLES}
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
    wait_for(lambda: ready.exists() or server.poll() is not None)
    assert server.poll() is None, cluster.logs()
    # The health service starts before the core listens: it answers now, and
    # the cluster cannot have met, for no worker exists yet.
    assert check(port) == "NOT_SERVING", cluster.logs()
    assert check(port, health.SERVICE_CLUSTER) == "NOT_SERVING"
    assert check(port, health.SERVICE_LIVE) == "SERVING"

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    worker = cluster([sys.executable, str(script), str(tmp_path / "never")], DMLC_ROLE="worker",
                     DMLC_WORKER_ID="0", DMLC_PS_ROOT_PORT=ready.read_text().strip())
    assert check(port, until=["SERVING"]) == "SERVING", cluster.logs()
    assert check(port, health.SERVICE_LIVE) == "SERVING"

    os.killpg(worker.pid, signal.SIGKILL)    # a lost peer: no more heartbeats
    assert check(port, until=["NOT_SERVING", GONE]) in ("NOT_SERVING", GONE), cluster.logs()
    assert check(port, health.SERVICE_LIVE) in ("NOT_SERVING", GONE)
    assert server.wait(timeout=30) == 1, cluster.logs()
    assert check(port) == GONE


def test_a_finished_job_closes_the_health_port(cluster, tmp_path):
    port = free_port()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    (tmp_path / "go").touch()
    # Through bpslaunch: its --health-port reaches the one server.
    proc = subprocess.run([sys.executable, "-m", "bps_tf.launch", "-np", "1", "--servers", "1",
                           "--health-port", str(port), "--timeout", "60", sys.executable,
                           str(script), str(tmp_path / "go")],
                          capture_output=True, text=True, timeout=90, cwd=tempfile.gettempdir(),
                          env={k: v for k, v in os.environ.items()
                               if k not in environments.PLACEMENT_VARIABLES})
    assert proc.returncode == 0, proc.stderr
    assert f"gRPC health on port {port}" in proc.stderr.splitlines()[0]
    assert "[worker 0] JOINED" in proc.stdout
    assert check(port) == GONE
