"""A multi-host job driven by TF_CONFIG, each task on its own network-namespace "host".

The layout is what Kubeflow's TFJob gives a job with 1 chief, 1 worker and 2 ps
(see examples/k8s/tfjob.yaml), with IP addresses in place of Service names:

    hub namespace: bridge br0
      ├── veth ── chief-0 namespace   10.98.0.1   (worker rank 0)
      ├── veth ── worker-0 namespace  10.98.0.2   (worker rank 1)
      ├── veth ── ps-0 namespace      10.98.0.11  (server 0 + scheduler, :2222)
      └── veth ── ps-1 namespace      10.98.0.12  (server 1, :2222)

Every address lives inside namespaces this test creates; the root namespace
gets no interface and no address. Each task also gets its own UTS namespace
and host name, so the scheduler sees four machines, not one.

In each namespace the test runs the same command, `bpslaunch <numpy worker>`,
with only that task's TF_CONFIG, exactly as every pod of a TFJob does. The
workers check that every sum is exact (tests/workers/engine_checks.py).

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for namespaces); skipped otherwise.
Everything it creates is removed in `finally`, processes first.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = os.path.join(ROOT, "tests", "workers", "engine_checks.py")
PORT = 2222
SUBNET_PREFIX = "10.98.0."
TASKS = {           # task -> host part of its address
    ("chief", 0): 1,
    ("worker", 0): 2,
    ("ps", 0): 11,
    ("ps", 1): 12,
}
JOB_TIMEOUT_S = 150          # bpslaunch's own --timeout, per task
WAIT_TIMEOUT_S = 200         # for all tasks together, then the test kills them
IP_TIMEOUT_S = 20
PARTITION_BYTES = 64 * 1024  # small pieces, so tensors spread over both servers

# Runs the rest of argv under a new host name (inside `unshare --uts`).
_SET_HOSTNAME = ("import os, socket, sys; socket.sethostname(sys.argv[1]); "
                 "os.execvp(sys.argv[2], sys.argv[2:])")


def _ip(*args, check=True):
    proc = subprocess.run(["ip"] + list(args), capture_output=True, text=True,
                          timeout=IP_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def _require_namespaces(probe_name):
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_NET_ADMIN); not running as root")
    for tool in ("ip", "unshare"):
        if not shutil.which(tool):
            pytest.skip(f"`{tool}` is not installed (iproute2 / util-linux)")
    proc = _ip("netns", "add", probe_name, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot create a network namespace (no CAP_NET_ADMIN?): "
                    f"{proc.stderr.strip()}")
    _ip("netns", "del", probe_name, check=False)


class NamespaceHosts:
    """A hub namespace with a bridge and one namespace per task, wired to it."""

    def __init__(self, token):
        self.hub = f"bpstf-{token}-hub"
        self.names = {task: f"bpstf-{token}-{task[0]}{task[1]}" for task in TASKS}
        self.created = []

    def build(self):
        self._add(self.hub)
        _ip("-n", self.hub, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for task, host in TASKS.items():
            ns = self.names[task]
            self._add(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # The pair is born inside the hub, its far end straight in the
            # task's namespace: neither end ever appears in the root namespace.
            hub_end = f"v-{task[0]}{task[1]}"
            _ip("-n", self.hub, "link", "add", hub_end, "type", "veth",
                "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.hub, "link", "set", hub_end, "master", "br0")
            _ip("-n", self.hub, "link", "set", hub_end, "up")
            _ip("-n", ns, "addr", "add", f"{SUBNET_PREFIX}{host}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def _add(self, name):
        _ip("netns", "add", name)
        self.created.append(name)

    def kill_leftover_processes(self):
        for name in self.created:
            pids = _ip("netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass

    def remove(self):
        # Deleting a namespace destroys its veth ends and, with them, the pairs.
        for name in reversed(self.created):
            _ip("netns", "del", name, check=False)
        self.created = []


def _tf_config(task):
    cluster = {}
    for (task_type, index), host in sorted(TASKS.items()):
        cluster.setdefault(task_type, []).append(f"{SUBNET_PREFIX}{host}:{PORT}")
    return json.dumps({"cluster": cluster, "task": {"type": task[0], "index": task[1]},
                       "environment": "cloud"})


def _bpslaunch():
    script = os.path.join(os.path.dirname(sys.executable), "bpslaunch")
    if os.access(script, os.X_OK):
        return [script]
    return [sys.executable, "-m", "bps_tf.launch"]    # the same entry point


def _stop(procs):
    for proc, _ in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)    # bpslaunch stops its children
    deadline = time.time() + 10
    for proc, _ in procs.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_tf_config_job_across_namespace_hosts(tmp_path):
    token = uuid.uuid4().hex[:6]
    _require_namespaces(f"bpstf-{token}-probe")
    hosts = NamespaceHosts(token)
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    base_env = {k: v for k, v in os.environ.items()
                if k not in ("TF_CONFIG", "BYTEPS_BIND_HOST") and not k.startswith("DMLC_")}
    base_env.update(BYTEPS_PARTITION_BYTES=str(PARTITION_BYTES),
                    BYTEPS_RENDEZVOUS_TIMEOUT="60", TF_CPP_MIN_LOG_LEVEL="2",
                    # One token for the job, as a TFJob's Secret gives every pod.
                    BYTEPS_JOB_TOKEN=uuid.uuid4().hex)
    procs = {}
    try:
        hosts.build()
        for task in TASKS:
            env = dict(base_env, TF_CONFIG=_tf_config(task))
            if task == ("ps", 1):
                # The BYTEPS_BIND_HOST override: listen on its own address only.
                env["BYTEPS_BIND_HOST"] = f"{SUBNET_PREFIX}{TASKS[task]}"
            cmd = (["ip", "netns", "exec", hosts.names[task], "unshare", "--uts", "--",
                    sys.executable, "-c", _SET_HOSTNAME, f"host-{task[0]}-{task[1]}"]
                   + _bpslaunch() + ["--timeout", str(JOB_TIMEOUT_S),
                                     sys.executable, CHECKS, "sums", str(out_dir)])
            log = open(tmp_path / f"{task[0]}{task[1]}.log", "w+")
            procs[task] = (subprocess.Popen(cmd, env=env, cwd=str(tmp_path), stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True),
                           log)
        deadline = time.time() + WAIT_TIMEOUT_S
        while time.time() < deadline and any(p.poll() is None for p, _ in procs.values()):
            time.sleep(0.2)
        logs = {}
        for task, (proc, log) in procs.items():
            log.seek(0)
            logs[task] = log.read()[-3000:]
        still_running = [t for t, (p, _) in procs.items() if p.poll() is None]
        assert not still_running, f"still running after {WAIT_TIMEOUT_S} s: {still_running}\n{logs}"
        for task, (proc, _) in procs.items():
            assert proc.returncode == 0, f"{task} exited {proc.returncode}:\n{logs[task]}"
    finally:
        _stop(procs)
        for _, log in procs.values():
            log.close()
        hosts.kill_leftover_processes()
        hosts.remove()
    assert not [n for n in _ip("netns", "list").stdout.split() if token in n]

    results = {}
    for name in os.listdir(out_dir):
        with open(out_dir / name) as f:
            results[int(name[4:-5])] = json.load(f)
    assert sorted(results) == [0, 1]
    for rank, r in results.items():
        assert (r["rank"], r["size"]) == (rank, 2)
        # Different host names: each worker is alone on its machine.
        assert (r["local_rank"], r["local_size"]) == (0, 1)
        assert r["checked"] > 0 and r["bad"] == [], r
        assert r["stats"]["frames_dropped"] == 0
        assert r["stats"]["links_local"] == 0  # the servers are other "hosts": TCP
