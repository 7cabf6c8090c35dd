"""Local reduce: the workers of one host sum through shared memory and one of
them pushes the host's sum (bps_tf/core/local_reduce.{h,cc}, docs/engine.md).

Loopback: 4 workers as 2 "hosts" (127.0.0.1 and 127.0.0.2, set by the worker
script) of 2 workers each, 2 servers. Network namespaces: the same on 4
namespaced hosts (2 with two workers each, 2 with a server each); root only.
"""
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from cluster_runner import ROOT, launch, passed_details, results

CHECKS = os.path.join(ROOT, "tests", "workers", "local_reduce_checks.py")
PART = 65536
# 5 dtypes x (0 + 1 + 1 + 1 + 4 partitions) + 3 rounds of one small tensor.
PARTITIONS = 5 * 7 + 3
NUMPY_OPS = 5 * 5 + 3
# The worker script's helpers, before whatever PYTHONPATH the suite runs with.
ENV = {"BYTEPS_PARTITION_BYTES": str(PART), "BYTEPS_TIMEOUT": "5",
       "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(ROOT, "tests", "workers"),
                                                   os.environ.get("PYTHONPATH")]))}


def _run(tmp_path, mode, env):
    # The workers end with os._exit (one dies on purpose), so TensorFlow's
    # atexit never removes its autograph files: they go to the test's folder.
    proc = launch(4, 2, [CHECKS, mode, str(tmp_path)],
                  env=dict(ENV, TMPDIR=str(tmp_path), **env), timeout=300)
    log = (f"bpslaunch exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n"
           f"--- stderr\n{proc.stderr[-5000:]}")
    found = results(str(tmp_path))
    assert sorted(found) == [0, 1, 2, 3], "missing worker results\n" + log
    return found, log


def test_two_hosts_of_two_workers_sum_exactly_with_one_push_per_host(tmp_path):
    found, log = _run(tmp_path, "on", {"BYTEPS_LOCAL_REDUCE": "auto",
                                       "BYTEPS_DEBUG_SEND_LOG": "1"})
    passed_details(found, log, "numpy_sums")
    pushed = passed_details(found, log, "priorities_kept")
    assert [pushed[r]["pushed"] for r in range(4)] == [PARTITIONS, 0, PARTITIONS, 0], pushed
    init = passed_details(found, log, "init")
    assert [init[r]["local_rank"] for r in range(4)] == [0, 1, 0, 1]
    # Horovod's cross rank/size: the two hosts, for either local rank
    assert [init[r]["cross_rank"] for r in range(4)] == [0, 0, 1, 1], init
    assert all(init[r]["cross_size"] == 2 and init[r]["homogeneous"] for r in range(4)), init
    maps = passed_details(found, log, "memory_follows_bytes_in_flight")
    # Members map their own memfds, roots their members'; 40 new names add none.
    assert all(maps[r]["before"] > 0 and maps[r]["after"] == maps[r]["before"]
               for r in range(4)), maps
    sent = passed_details(found, log, "stats_after_numpy")
    # Servers get one push per host: only each host's root (0 and 2) sends.
    assert [sent[r]["partitions_sent"] for r in range(4)] == [PARTITIONS, 0, PARTITIONS, 0], sent
    assert all(sent[r]["local_reduce_ops"] == NUMPY_OPS for r in range(4)), sent
    fused = passed_details(found, log, "fused_host_sums")
    # Only roots push, and their small host sums went out in fused messages.
    assert [fused[r]["partitions_sent"] for r in range(4)] == [64, 0, 64, 0], fused
    assert fused[0]["fused_messages_sent"] >= 1 and fused[2]["fused_messages_sent"] >= 1, fused
    assert fused[1]["fused_messages_sent"] == 0 and fused[3]["fused_messages_sent"] == 0, fused
    passed_details(found, log, "tf_sums")
    bypass = passed_details(found, log, "compressed_bypass")
    assert all(bypass[r]["partitions_sent"] == 1 for r in range(4)), bypass
    # A process set's members and a Min push for themselves (exact values are
    # checked in the worker); join() is refused on every rank with the setting.
    other = passed_details(found, log, "sets_min_broadcast_join")
    assert [other[r]["set_sent"] for r in range(4)] == [0, 1, 1, 1], other
    assert all(other[r]["min_sent"] == 1 for r in range(4)), other
    for r in range(4):
        assert ("join is not available with local reduce; set BYTEPS_LOCAL_REDUCE=0"
                in other[r]["join_error"]), other[r]
    # A shape that differs inside one host fails on every worker, not a hang.
    errors = passed_details(found, log, "shape_mismatch")
    for r in (0, 1):
        assert "differs on this host: worker 0 has float32[3,4]" in errors[r], errors[r]
        assert "worker 1 has float32[4,3]" in errors[r], errors[r]
    for r in (2, 3):
        assert "np/mismatch" in errors[r] and "differs" in errors[r], errors[r]
    # Worker 1 died: its root fails at once with an error that names it.
    death = passed_details({0: found[0]}, log, "peer_death")[0]
    assert "worker 1 on this host closed its connection" in death["error"], death
    assert death["seconds"] < 10, death


def test_off_switch_every_worker_pushes(tmp_path):
    found, log = _run(tmp_path, "off", {"BYTEPS_LOCAL_REDUCE": "0"})
    passed_details(found, log, "numpy_sums")
    sent = passed_details(found, log, "stats_after_numpy")
    assert [sent[r]["partitions_sent"] for r in range(4)] == [PARTITIONS] * 4, sent
    assert all(sent[r]["local_reduce_ops"] == 0 for r in range(4)), sent


def test_setting_parses_auto_and_refuses_garbage():
    from bps_tf.runtime import config
    assert config.value("BYTEPS_LOCAL_REDUCE", {}) == -1
    assert config.value("BYTEPS_LOCAL_REDUCE", {"BYTEPS_LOCAL_REDUCE": "0"}) == 0
    assert config.value("BYTEPS_LOCAL_REDUCE", {"BYTEPS_LOCAL_REDUCE": "on"}) == 1
    with pytest.raises(ValueError, match="BYTEPS_LOCAL_REDUCE"):
        config.value("BYTEPS_LOCAL_REDUCE", {"BYTEPS_LOCAL_REDUCE": "sometimes"})


def _ip(*args, check=True):
    proc = subprocess.run(["ip"] + list(args), capture_output=True, text=True, timeout=20)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def _namespaces(token, count):
    """A hub namespace with a bridge, and `count` namespaced hosts on it
    (10.97.0.1, ...); returns the names created, hub first."""
    hub = f"bpslr-{token}-hub"
    created = [hub]
    _ip("netns", "add", hub)
    _ip("-n", hub, "link", "add", "br0", "type", "bridge")
    _ip("-n", hub, "link", "set", "br0", "up")
    for i in range(count):
        ns = f"bpslr-{token}-h{i}"
        _ip("netns", "add", ns)
        created.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", hub, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", hub, "link", "set", f"v{i}", "master", "br0")
        _ip("-n", hub, "link", "set", f"v{i}", "up")
        _ip("-n", ns, "addr", "add", f"10.97.0.{i + 1}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
    return created


def test_two_namespaced_hosts_of_two_workers(tmp_path):
    """Hosts h0 and h1 run two workers each, h2 and h3 a server each; one
    machine, so only the network namespace tells the hosts apart."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_NET_ADMIN); not running as root")
    if not shutil.which("ip"):
        pytest.skip("`ip` (iproute2) is not installed")
    token = uuid.uuid4().hex[:6]
    probe = _ip("netns", "add", f"bpslr-{token}-probe", check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {probe.stderr.strip()}")
    _ip("netns", "del", f"bpslr-{token}-probe", check=False)
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("DMLC_", "BYTEPS_")) and k != "TF_CONFIG"}
    base.update(ENV, BYTEPS_LOCAL_REDUCE="auto", DMLC_NUM_WORKER="4", DMLC_NUM_SERVER="2",
                DMLC_PS_ROOT_URI="10.97.0.3", DMLC_PS_ROOT_PORT="2222",
                BYTEPS_JOB_TOKEN=uuid.uuid4().hex, BYTEPS_RENDEZVOUS_TIMEOUT="60")
    procs = []
    names = []
    try:
        names = _namespaces(token, 4)
        roles = [("server", 0, 2), ("server", 1, 3)] + [("worker", r, r // 2) for r in range(4)]
        for role, idx, host in roles:
            env = dict(base, DMLC_ROLE=role)
            if role == "server":
                env.update(BYTEPS_SERVER_ID=str(idx), BYTEPS_SERVER_PORT="2222",
                           DMLC_NODE_HOST=f"10.97.0.{host + 1}",
                           BYTEPS_BIND_HOST=f"10.97.0.{host + 1}")
                if idx == 0:
                    env["BYTEPS_HOST_SCHEDULER"] = "1"
                argv = [sys.executable, "-m", "bps_tf.server"]
            else:
                env["DMLC_WORKER_ID"] = str(idx)
                argv = [sys.executable, CHECKS, "netns", str(out_dir)]
            log = open(tmp_path / f"{role}{idx}.log", "w+")
            procs.append((subprocess.Popen(["ip", "netns", "exec", names[1 + host]] + argv,
                                           env=env, cwd=str(tmp_path), stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True),
                          log, f"{role}{idx}"))
        deadline = time.time() + 150
        while time.time() < deadline and any(p.poll() is None for p, _, _ in procs):
            time.sleep(0.2)
        logs = ""
        for p, log, who in procs:
            log.seek(0)
            logs += f"--- {who} (exit {p.poll()})\n{log.read()[-2000:]}\n"
        assert all(p.poll() == 0 for p, _, _ in procs), logs
    finally:
        for p, log, _ in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            log.close()
        for ns in reversed(names):
            _ip("netns", "del", ns, check=False)
    found = results(str(out_dir))
    assert sorted(found) == [0, 1, 2, 3], logs
    passed_details(found, logs, "numpy_sums")
    sent = passed_details(found, logs, "stats_after_numpy")
    assert [sent[r]["partitions_sent"] for r in range(4)] == [PARTITIONS, 0, PARTITIONS, 0], sent
