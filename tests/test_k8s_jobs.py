"""The Kubernetes manifests' jobs, run on this machine from exactly the pods' environment.

tests/k8s_render.py makes the pods of examples/k8s/jobset.yaml and
examples/k8s/indexed-job-elastic.yaml as the controllers would; each pod's
container command (``bpslaunch python examples/keras_digits.py``) runs with
that pod's environment (downward-API values, JOB_COMPLETION_INDEX, the token
from a Secret made as ``kubectl create secret`` makes it) and only these
changes, which stand in for the cluster:

* ``BYTEPS_K8S_TEST_HOSTS`` maps each pod's DNS name to a loopback address of
  its own (127.77.x.n): the test-only override of bps_tf/runtime/k8s_cluster.py;
* ports the OS says are free replace 2222/2223 (``DMLC_PS_ROOT_PORT``,
  ``BYTEPS_HEALTH_PORT``), and the image's /app is this repository;
* fewer epochs (``--epochs 10``); in the elastic job a short ``BYTEPS_TIMEOUT``
  (10 s instead of 30, times BPS_TEST_TIMEOUT_SCALE / 2) and a wrapper with gates
  (tests/workers/k8s_digits_gated.py) so the pods change mid-training.

The JobSet job starts its workers when every server pod is ready, as
``startupPolicyOrder: InOrder`` does, asking each server's gRPC health port as
its readiness probe would. The elastic Indexed Job gains a pod (scaled to 3)
and loses one (scaled back to 2: SIGTERM, as the kubelet stops a deleted pod)
while it trains, and must finish with every epoch in History once.
"""
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k8s_render as render  # noqa: E402
from cluster_runner import TIMEOUT_SCALE  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "k8s")
GATED = os.path.join(ROOT, "tests", "workers", "k8s_digits_gated.py")
TOKEN = "k8s-jobs-test-token-5f0c2a9e"
EPOCHS = "10"
JOB_TIMEOUT_S = 240 * TIMEOUT_SCALE
# Variables of the developer's shell that would place a process: a container has none.
_PLACING = re.compile(r"^(DMLC_|BYTEPS_|HOROVOD_|TF_CONFIG$|JOB_|JOBSET_NAME$|REPLICATED_JOB_NAME$)")


class Pod:
    """One pod's container: its command with its rendered environment, output to a file."""

    def __init__(self, pod, address, workdir, wrapper=()):
        self.pod, self.address = pod, address
        self.name = pod["spec"]["hostname"]
        self.env = None
        self.wrapper = list(wrapper)
        self.log_path = os.path.join(workdir, self.name + ".log")
        self.proc = None

    def start(self, secrets, overrides):
        container = self.pod["spec"]["containers"][0]
        self.env = render.container_env(self.pod, container["name"], secrets)
        env = {k: v for k, v in os.environ.items() if not _PLACING.match(k)}
        env.update(self.env)
        env.update(overrides)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        argv = _argv(container["command"] + container.get("args", []), self.wrapper)
        self.log = open(self.log_path, "wb")
        # From a neutral directory: the image's /app is this repository, named in argv.
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=tempfile.gettempdir(), start_new_session=True)

    def output(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def delete(self):
        """As the kubelet stops a deleted pod: SIGTERM to the container's first process,
        SIGKILL to everything once the grace period is over."""
        self.proc.send_signal(signal.SIGTERM)
        self.deleted_at = time.monotonic()

    def reap(self):
        grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        try:
            self.proc.wait(timeout=max(0.0, self.deleted_at + grace - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def kill(self):
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        if self.proc:
            self.log.close()


def _argv(command, wrapper):
    """The container's command on this machine: bpslaunch and python are this Python's, the
    script's path is under this repository (the image's /app), with fewer epochs; a
    ``wrapper`` (script and its arguments) runs the example inside it."""
    assert command[:2] == ["bpslaunch", "python"], command
    script = os.path.join(ROOT, command[2])
    assert os.path.isfile(script), script
    return ([sys.executable, "-m", "bps_tf.launch", sys.executable] + (wrapper or [script])
            + command[3:] + ["--epochs", EPOCHS])


def _addresses(count):
    """Loopback addresses of one /24 picked at random, so parallel runs do not meet."""
    base = f"127.77.{random.randrange(1, 255)}"
    return [f"{base}.{i + 1}" for i in range(count)]


def _free_port(addresses, avoid=()):
    """A port free on every one of the addresses (the servers all bind it)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind((addresses[0], 0))
            port = first.getsockname()[1]
            if port in avoid:
                continue
            others = []
            try:
                for address in addresses[1:]:
                    sock = socket.socket()
                    others.append(sock)
                    sock.bind((address, port))
                return port
            except OSError:
                continue
            finally:
                for sock in others:
                    sock.close()
    raise RuntimeError("no port free on every test address")


def _hosts(pods):
    return ",".join(f"{render.dns_name(p.pod)}={p.address}" for p in pods)


def _wait_until(condition, what, pods, timeout=JOB_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while not condition():
        failed = [p for p in pods if p.proc and p.proc.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            raise AssertionError(f"waiting for {what}: " + (
                f"{failed[0].name} exited {failed[0].proc.returncode}" if failed else "timed out")
                + _logs(pods))
        time.sleep(0.1)


def _logs(pods):
    return "".join(f"\n--- {p.name} (exit {p.proc.returncode if p.proc else '-'})\n"
                   f"{p.output()[-3000:]}" for p in pods if p.proc)


def _wait_all(pods, timeout=JOB_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    for pod in pods:
        try:
            pod.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{pod.name} still runs after {timeout:g} s" + _logs(pods))
    bad = [p for p in pods if p.proc.returncode != 0]
    assert not bad, f"{bad[0].name} exited {bad[0].proc.returncode}" + _logs(pods)


def _serving(address, port):
    """What a kubelet grpc readiness probe on service bps_tf.live sees."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(f"{address}:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="bps_tf.live"), timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _accuracy(output):
    match = re.search(r"test accuracy: ([0-9.]+), loss [0-9.]+ \((\d+) workers", output)
    assert match, output[-3000:]
    return float(match.group(1)), int(match.group(2))


def test_jobset_trains_the_digits_example(tmp_path):
    workdir = str(tmp_path)
    docs = render.load(os.path.join(EXAMPLES, "jobset.yaml"))
    js = render.find(docs, render.JOBSET)
    rendered = render.jobset_pods(js)
    pods = [Pod(p, a, workdir) for p, a in zip(rendered, _addresses(len(rendered)))]
    servers = [p for p in pods if "-server-" in p.name]
    workers = [p for p in pods if "-worker-" in p.name]
    port = _free_port([p.address for p in servers])
    health = _free_port([p.address for p in servers], avoid=(port,))
    secrets = [render.secret_from_literal("bps-tf-jobset-token", token=TOKEN)]
    common = {"BYTEPS_K8S_TEST_HOSTS": _hosts(pods), "DMLC_PS_ROOT_PORT": str(port)}
    try:
        for pod in servers:
            pod.start(secrets, {**common, "BYTEPS_HEALTH_PORT": str(health)})
        # InOrder: the workers' Job starts once every server pod is ready.
        _wait_until(lambda: all(_serving(p.address, health) for p in servers),
                    "the server pods' readiness", pods)
        for pod in workers:
            pod.start(secrets, common)
        _wait_all(pods)
    finally:
        for pod in pods:
            pod.kill()
    for pod in pods:
        # Each pod took its place from Kubernetes, and the token from the Secret.
        assert pod.env["BYTEPS_JOB_TOKEN"] == TOKEN
        start = pod.output()
        assert f"(from Kubernetes, host {pod.name})" in start, start[-2000:]
        assert "job token from BYTEPS_JOB_TOKEN" in start, start[-2000:]
    assert "hosts the scheduler" in servers[0].output()
    accuracy, size = _accuracy(workers[0].output())
    assert accuracy >= 0.9 and size == 2
    assert "test accuracy" not in workers[1].output()       # only rank 0 prints


def test_elastic_indexed_job_gains_and_loses_a_worker_while_training(tmp_path):
    workdir = str(tmp_path)
    docs = render.load(os.path.join(EXAMPLES, "indexed-job-elastic.yaml"))
    server_job = render.find(docs, render.JOB, "bps-tf-elastic-server")
    worker_job = render.find(docs, render.JOB, "bps-tf-elastic-worker")
    rendered = render.indexed_job_pods(server_job) + render.indexed_job_pods(worker_job, completions=3)
    addresses = _addresses(len(rendered))
    gated = [GATED, workdir, "2", "5"]      # newcomer at epoch 2, the deletion at 5
    pods = [Pod(p, a, workdir, gated) for p, a in zip(rendered, addresses)]
    servers, workers, newcomer = pods[:2], pods[2:4], pods[4]
    port = _free_port([p.address for p in servers])
    health = _free_port([p.address for p in servers], avoid=(port,))
    secrets = [render.secret_from_literal("bps-tf-elastic-token", token=TOKEN)]
    # A killed worker is noticed after BYTEPS_TIMEOUT (30 s by default), which is also how long
    # the others have to come back after a change: short, but not so short that a worker slowed
    # down by a loaded machine is dropped.
    common = {"DMLC_PS_ROOT_PORT": str(port), "BYTEPS_TIMEOUT": str(int(5 * TIMEOUT_SCALE))}

    def discovered(running):
        # What the DNS discovery helper lists for the pods that exist now.
        argv = ["--job", "bps-tf-elastic-worker", "--service", "bps-tf-elastic", "--max-pods", "4"]
        env = dict(os.environ, BYTEPS_K8S_TEST_HOSTS=_hosts(running))
        proc = subprocess.run([sys.executable, "-m", "bps_tf.launch.k8s_discovery"] + argv,
                              env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    try:
        start = servers + workers
        for pod in start:
            pod.start(secrets, {**common, "BYTEPS_K8S_TEST_HOSTS": _hosts(start),
                                **({"BYTEPS_HEALTH_PORT": str(health)} if pod in servers else {})})
        _wait_until(lambda: os.path.exists(os.path.join(workdir, "gate1")),
                    "2 workers training", pods)
        assert discovered(start) == [f"{render.dns_name(p.pod)}:1" for p in workers]
        # kubectl patch job bps-tf-elastic-worker: completions and parallelism 3.
        newcomer.start(secrets, {**common, "BYTEPS_K8S_TEST_HOSTS": _hosts(start + [newcomer])})
        _wait_until(lambda: all(os.path.exists(os.path.join(workdir, f"gate2_{i}"))
                                for i in range(3)), "3 workers training", pods)
        assert len(discovered(start + [newcomer])) == 3
        # Back to 2: the Job controller deletes the highest index, the kubelet sends SIGTERM.
        newcomer.delete()
        with open(os.path.join(workdir, "go2"), "w"):
            pass
        assert len(discovered(start)) == 2
        newcomer.reap()
        _wait_all(start)
    finally:
        for pod in pods:
            pod.kill()
    scheduler = servers[0].output()
    three = scheduler.find("starts with 3 worker(s)")
    assert three >= 0 and scheduler.find("starts with 2 worker(s)", three) > three, scheduler[-3000:]
    assert "worker (newcomer: joins the running job)" in newcomer.output()
    rank0 = workers[0].output()
    accuracy, size = _accuracy(rank0)
    assert accuracy >= 0.9 and size == 2
    history = re.search(r"HISTORY (\[.*\])", rank0)
    assert history and json.loads(history.group(1)) == list(range(int(EPOCHS))), rank0[-3000:]


def test_elastic_indexed_job_survives_the_loss_of_server_0s_pod(tmp_path):
    """Server 0's pod, which runs the scheduler, is lost mid-training; the Job
    controller makes a new pod with the same index, name and address (the
    manifest's backoffLimit allows it). The workers and server 1 re-register
    with the scheduler in it, the new server 0 joins, and training goes on
    from the last commit to the end."""
    workdir = str(tmp_path)
    docs = render.load(os.path.join(EXAMPLES, "indexed-job-elastic.yaml"))
    server_job = render.find(docs, render.JOB, "bps-tf-elastic-server")
    worker_job = render.find(docs, render.JOB, "bps-tf-elastic-worker")
    assert server_job["spec"]["backoffLimit"] > 0      # a lost server pod is replaced
    rendered = render.indexed_job_pods(server_job) + render.indexed_job_pods(worker_job)
    addresses = _addresses(len(rendered))
    no_gates = [GATED, workdir, "99", "99"]           # only for its HISTORY line
    pods = [Pod(p, a, workdir, no_gates) for p, a in zip(rendered, addresses)]
    servers, workers = pods[:2], pods[2:4]
    port = _free_port([p.address for p in servers])
    health = _free_port([p.address for p in servers], avoid=(port,))
    secrets = [render.secret_from_literal("bps-tf-elastic-token", token=TOKEN)]
    common = {"DMLC_PS_ROOT_PORT": str(port), "BYTEPS_TIMEOUT": str(int(5 * TIMEOUT_SCALE)),
              "BYTEPS_K8S_TEST_HOSTS": _hosts(pods)}
    server_env = {**common, "BYTEPS_HEALTH_PORT": str(health)}
    replacement = Pod(servers[0].pod, servers[0].address, workdir)
    replacement.log_path = os.path.join(workdir, "server-0-replacement.log")
    try:
        for pod in servers + workers:
            pod.start(secrets, server_env if pod in servers else common)
        _wait_until(lambda: "Epoch 3/" in workers[0].output(), "epoch 3", pods)
        servers[0].kill()          # the node is lost: SIGKILL, no grace
        replacement.start(secrets, server_env)
        _wait_all([servers[1], replacement] + workers)
    finally:
        for pod in pods + [replacement]:
            pod.kill()
    scheduler = replacement.output()
    assert "this scheduler was restarted" in scheduler, scheduler[-3000:]
    assert "starts with 2 worker(s) (the scheduler restarted)" in scheduler, scheduler[-3000:]
    rank0 = workers[0].output()
    accuracy, size = _accuracy(rank0)
    assert accuracy >= 0.9 and size == 2
    history = re.search(r"HISTORY (\[.*\])", rank0)
    assert history and json.loads(history.group(1)) == list(range(int(EPOCHS))), rank0[-3000:]
