"""What a hand-started cluster tells its user (numpy workers, no TensorFlow).

A node that cannot reach its scheduler says so while it waits, naming the
address and where it came from (TF_CONFIG or DMLC_*), and its final error is
worded in the same terms. A worker stopped by Ctrl-C is named as interrupted
in the other workers' errors, and the servers exit non-zero: the job failed.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from manual_cluster import ROOT, ManualCluster  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "workers", "robust_worker.py")
FAST_FAILURE = {"BYTEPS_TIMEOUT": "3", "BYTEPS_HEARTBEAT_INTERVAL": "0.5",
                "BYTEPS_FATAL_EXIT_GRACE": "2"}
# Waiting lines come every third of a short rendezvous timeout: at 2 s and 4 s.
RENDEZVOUS_S = 6
JOIN = "import bps_tf; bps_tf.init()"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("DMLC_")}
    env.update(BYTEPS_RENDEZVOUS_TIMEOUT=str(RENDEZVOUS_S), BYTEPS_JOB_TOKEN="t" * 32,
               TF_CPP_MIN_LOG_LEVEL="2", **extra)
    return env


def _tf_config(task_type, index, ps_port, worker_ports):
    return json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in worker_ports],
                                   "ps": [f"127.0.0.1:{ps_port}"]},
                       "task": {"type": task_type, "index": index}})


def _run(argv, env):
    return subprocess.Popen(argv, env=env, cwd=tempfile.gettempdir(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_a_missing_scheduler_is_reported_while_waiting_in_the_users_terms():
    """Nothing listens at the scheduler's address: a TF_CONFIG worker, a
    DMLC_* worker and a DMLC_* server each log where they wait and why, then
    fail naming their own configuration (TF_CONFIG users never read about
    DMLC_* variables)."""
    dead = _free_port()
    tf_config = _tf_config("worker", 1, dead, [_free_port(), _free_port()])
    dmlc = dict(DMLC_NUM_WORKER="2", DMLC_NUM_SERVER="1", DMLC_PS_ROOT_URI="127.0.0.1",
                DMLC_PS_ROOT_PORT=str(dead))
    started = time.time()
    procs = {
        "tf_config": _run([sys.executable, "-c", JOIN], _env(TF_CONFIG=tf_config)),
        "dmlc": _run([sys.executable, "-c", JOIN],
                     _env(DMLC_ROLE="worker", DMLC_WORKER_ID="1", **dmlc)),
        "server": _run([sys.executable, "-m", "bps_tf.server"], _env(DMLC_ROLE="server", **dmlc)),
    }
    logs = {name: p.communicate(timeout=60)[0] for name, p in procs.items()}
    assert time.time() - started < RENDEZVOUS_S + 20
    address = f"tcp://127.0.0.1:{dead}"
    for name, log in logs.items():
        assert procs[name].returncode != 0, log
        origin = "TF_CONFIG's ps task 0" if name == "tf_config" else \
            "DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT"
        waiting = f"waiting for the scheduler at {address} (from {origin}) for "
        assert log.count(waiting) >= 2, log          # at 2 s and at 4 s
        assert "no answer yet" in log, log
        assert (f"could not meet the cluster at the scheduler {address} within {RENDEZVOUS_S} s "
                f"(BYTEPS_RENDEZVOUS_TIMEOUT): it never answered; check {origin}") in log, log
    assert "DMLC" not in logs["tf_config"], logs["tf_config"]
    assert "server -1" not in logs["server"], logs["server"]


def test_a_missing_worker_is_named_by_the_scheduler_while_the_others_wait():
    """The ps task that hosts the scheduler and one of two workers start:
    the worker says the scheduler answered and it waits for the others; the
    ps names the worker that has not joined; both fail in TF_CONFIG's terms."""
    ps_port, workers = _free_port(), [_free_port(), _free_port()]
    ps = _run([sys.executable, "-m", "bps_tf.server"],
              _env(TF_CONFIG=_tf_config("ps", 0, ps_port, workers)))
    worker = _run([sys.executable, "-c", JOIN],
                  _env(TF_CONFIG=_tf_config("worker", 0, ps_port, workers)))
    worker_log = worker.communicate(timeout=60)[0]
    ps.send_signal(signal.SIGTERM)
    ps_log = ps.communicate(timeout=30)[0]
    assert worker.returncode != 0
    assert f"the scheduler at tcp://127.0.0.1:{ps_port} answered; waiting for the other " \
           "workers and servers of TF_CONFIG's cluster" in worker_log, worker_log
    assert "it answered, but not every worker and server joined; check that every node of " \
           "TF_CONFIG's cluster" in worker_log, worker_log
    assert "DMLC" not in worker_log, worker_log
    assert "not joined yet: worker(s) 1 (2 of 3 nodes joined)" in ps_log, ps_log


def test_a_scheduler_nobody_reaches_fails_after_the_rendezvous_timeout():
    """A ps task that hosts the scheduler (TF_CONFIG) and a scheduler of its
    own (DMLC_ROLE=scheduler), with no other node started: each gives up
    after BYTEPS_RENDEZVOUS_TIMEOUT (and its margin), naming the nodes that
    never joined, instead of waiting for ever."""
    limit = 1
    ps_env = _env(TF_CONFIG=_tf_config("ps", 0, _free_port(), [_free_port()]))
    dmlc_env = _env(DMLC_ROLE="scheduler", DMLC_NUM_WORKER="2", DMLC_NUM_SERVER="1",
                    DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(_free_port()))
    for env in (ps_env, dmlc_env):
        env["BYTEPS_RENDEZVOUS_TIMEOUT"] = str(limit)
    started = time.time()
    procs = {name: _run([sys.executable, "-m", "bps_tf.server"], env)
             for name, env in (("ps", ps_env), ("scheduler", dmlc_env))}
    logs = {name: proc.communicate(timeout=60)[0] for name, proc in procs.items()}
    # The margin: a fifth more and 2 s; then 3 s telling late joiners why.
    assert time.time() - started < limit * 1.2 + 2 + 3 + 15, logs
    for name, proc in procs.items():
        assert proc.returncode != 0, (name, logs[name])
        assert f"the cluster did not meet within {limit} s (BYTEPS_RENDEZVOUS_TIMEOUT): " \
               "not joined yet: worker(s) 0" in logs[name], (name, logs[name])
    assert "(1 of 2 nodes joined)" in logs["ps"], logs["ps"]
    assert "worker(s) 0, 1; 1 of 1 servers (0 of 3 nodes joined)" in logs["scheduler"], logs


def test_an_interrupted_worker_is_named_and_the_servers_exit_non_zero(tmp_path):
    """Ctrl-C (SIGINT) on worker 1 of a running job: worker 0's push_pull
    fails saying so (not "every worker must make the same push_pulls"), and
    both servers, the scheduler's host included, exit non-zero naming it."""
    with ManualCluster(2, 2, [WORKER, "loop", str(tmp_path)], env=FAST_FAILURE) as c:
        deadline = time.time() + 60
        while not all((tmp_path / f"joined{r}").exists() for r in range(2)):
            assert time.time() < deadline, c.log("worker0")
            time.sleep(0.05)
        time.sleep(0.5)
        c.workers[1].send_signal(signal.SIGINT)
        assert c.wait_all(c.workers + c.servers, timeout=30), "a process hung"
        w0 = c.log("worker0")
        assert c.workers[0].returncode == 3, w0
        assert "push_pull failed: " in w0 and "worker 1 (host " in w0, w0
        assert "was interrupted (SIGINT) and has left the job" in w0, w0
        assert "every worker must make the same push_pulls" not in w0, w0
        for s, server in enumerate(c.servers):
            log = c.log(f"server{s}")
            assert server.returncode != 0, log
            assert "the job failed: worker 1 (host " in log, log
            assert "was interrupted (SIGINT)" in log, log


def test_a_job_whose_workers_finish_ends_with_exit_0(tmp_path):
    """The counterpart: workers that shut down normally end the job with
    every server's exit 0."""
    env = dict(FAST_FAILURE, BYTEPS_PARTITION_BYTES="65536")
    with ManualCluster(2, 2, [WORKER, "exact", str(tmp_path), "5"], env=env) as c:
        assert c.wait_all(c.workers + c.servers, timeout=60), "a process hung"
        codes = [p.returncode for p in c.workers + c.servers]
        assert codes == [0, 0, 0, 0], [c.log(n) for n in ("worker0", "server0")]


def test_the_reason_a_worker_leaves_is_what_ended_its_program(monkeypatch):
    from bps_tf.runtime import basics
    monkeypatch.delattr(sys, "last_type", raising=False)
    monkeypatch.delattr(sys, "ps1", raising=False)
    assert basics.leave_reason() == ""
    monkeypatch.setattr(sys, "last_type", KeyboardInterrupt, raising=False)
    assert basics.leave_reason() == "was interrupted (SIGINT)"
    monkeypatch.setattr(sys, "last_type", ValueError, raising=False)
    monkeypatch.setattr(sys, "last_value", ValueError("bad\n  input"), raising=False)
    assert basics.leave_reason() == "failed (ValueError: bad input)"


def test_each_phase_boundary_says_what_the_worker_is_doing():
    from bps_tf.strategy import phases
    rows = [(phases.FIT, 10, 3), (phases.EPOCH_END, 3, 0), (phases.EPOCH_END, 9, 1),
            (phases.EVALUATE, -1, -1), (phases.PREDICT, 5, -1)]
    said = [phases.activity([phase, 7, a, b, -1]) for phase, a, b in rows]
    assert said == ["fit, epoch 4 of 10", "fit, epoch 5 of 10",
                    "the end of fit (after epoch 10 of 10)", "evaluate", "predict"]
