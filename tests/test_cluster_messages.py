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
# Waiting lines come every third of a short rendezvous timeout: at 2 s and 4 s,
# warnings from half of it (3 s) on.
RENDEZVOUS_S = 6
JOIN = "import bps_tf; bps_tf.init()"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("DMLC_")}
    env.update(BYTEPS_RENDEZVOUS_TIMEOUT=str(RENDEZVOUS_S), BYTEPS_JOB_TOKEN="t" * 32,
               TF_CPP_MIN_LOG_LEVEL="2")
    env.update(extra)
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
        # INFO shows the waiting lines that come before half of the timeout.
        "tf_config": _run([sys.executable, "-c", JOIN],
                          _env(TF_CONFIG=tf_config, BYTEPS_LOG_LEVEL="INFO")),
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
        lines = [line for line in log.splitlines() if waiting in line]
        # At 2 s an INFO line (nodes start seconds apart: not news yet), at
        # 4 s, past half of the timeout, a warning.
        warnings = [line for line in lines if " WARNING bps_tf " in line]
        assert warnings and all(" for 2 s" not in line for line in warnings), log
        if name == "tf_config":
            assert any(" INFO bps_tf " in line and " for 2 s" in line for line in lines), log
        else:
            assert all(" INFO " not in line for line in lines), log
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


def test_a_cluster_size_that_differs_is_named_in_tf_configs_terms():
    """A worker whose TF_CONFIG lists another cluster than the ps task's:
    the error says to give every node the same TF_CONFIG cluster, and never
    names a DMLC_* variable."""
    ps_port, workers = _free_port(), [_free_port(), _free_port()]
    ps = _run([sys.executable, "-m", "bps_tf.server"],
              _env(TF_CONFIG=_tf_config("ps", 0, ps_port, workers)))
    worker = _run([sys.executable, "-c", JOIN],
                  _env(TF_CONFIG=_tf_config("worker", 0, ps_port, workers + [_free_port()])))
    worker_log = worker.communicate(timeout=60)[0]
    ps.send_signal(signal.SIGTERM)      # it logged the error before it sent it to the worker
    ps_log = ps.communicate(timeout=30)[0]
    assert worker.returncode != 0, worker_log
    said = "cluster setting 'num_workers' disagrees: the scheduler has 2, worker 0 (host "
    fix = "has 3 (every node must be given the same TF_CONFIG's cluster (its chief, worker and ps tasks))"
    for log in (worker_log, ps_log):
        assert said in log and fix in log, log
        assert "DMLC" not in log, log


def test_a_newcomer_says_it_waits_to_be_admitted():
    """An elastic newcomer (bpslaunch starts one in a lost worker's place)
    has no rank yet: it logs as a new worker, says it waits to be admitted,
    and its failure says why it may not have been."""
    port = _free_port()
    dmlc = dict(DMLC_NUM_WORKER="1", DMLC_NUM_SERVER="1", DMLC_PS_ROOT_URI="127.0.0.1",
                DMLC_PS_ROOT_PORT=str(port), BYTEPS_ELASTIC="1", BYTEPS_RENDEZVOUS_TIMEOUT="3")
    server = _run([sys.executable, "-m", "bps_tf.server"],
                  _env(DMLC_ROLE="server", BYTEPS_HOST_SCHEDULER="1", **dmlc))
    try:
        newcomer = _run([sys.executable, "-c", JOIN],
                        _env(DMLC_ROLE="worker", DMLC_WORKER_ID="0", BYTEPS_ELASTIC_NEWCOMER="1",
                             **dmlc))
        log = newcomer.communicate(timeout=60)[0]
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=30)
    assert newcomer.returncode != 0, log
    assert (f"WARNING bps_tf new worker (waiting to join)] the scheduler at tcp://127.0.0.1:{port} "
            "answered; this new worker waits to be admitted into the running job at its next "
            "membership change (elastic)") in log, log
    assert "it answered, but did not admit this new worker: the job is at its largest size " \
           "(BYTEPS_ELASTIC_MAX_WORKERS), or its first workers never met (check that every node " \
           "of DMLC_NUM_WORKER/DMLC_NUM_SERVER was started)" in log, log
    assert "worker -1" not in log and "waiting for the other workers" not in log, log


def test_bpslaunch_jobs_are_described_by_its_options():
    """A local job's DMLC_* variables come from bpslaunch: its messages name
    -np and --servers (and the scheduler as its server 0) instead."""
    from bps_tf.launch import environments
    from bps_tf.runtime import cluster
    from bps_tf.launch import hosts
    shared = environments.job_env({"DMLC_NUM_WORKER": "9"}, 2, 1)
    slot = hosts.Slot("localhost", 1, 1, 2, 2, 0, 1)
    worker = cluster.resolve(environments.worker_env(shared, slot, 4000)).core_values()
    server = cluster.resolve(environments.server_env(shared, 0, 0, "/tmp/ready")).core_values()
    for values in (worker, server):
        assert values["members_origin"] == "bpslaunch -np 2 --servers 1"
        assert values["scheduler_origin"] == "bpslaunch's scheduler"
    # Set by hand, DMLC_* are named as such; a stale launcher value in the
    # caller's shell is not passed on.
    hand = dict(DMLC_ROLE="worker", DMLC_NUM_WORKER="2", DMLC_NUM_SERVER="1", DMLC_WORKER_ID="0",
                DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT="4000")
    assert cluster.resolve(hand).core_values()["members_origin"] == \
        "DMLC_NUM_WORKER/DMLC_NUM_SERVER"
    assert "BYTEPS_LAUNCHED_BY" not in environments.clean_env({"BYTEPS_LAUNCHED_BY": "x"})


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
    from bps_tf.runtime import basics, messages
    monkeypatch.delattr(sys, "last_type", raising=False)
    monkeypatch.delattr(sys, "ps1", raising=False)
    assert basics.leave_reason() == ""
    monkeypatch.setattr(sys, "last_type", KeyboardInterrupt, raising=False)
    assert basics.leave_reason() == "was interrupted (SIGINT)"
    monkeypatch.setattr(sys, "last_type", ValueError, raising=False)
    monkeypatch.setattr(sys, "last_value", ValueError("bad\n  input"), raising=False)
    assert basics.leave_reason() == "failed (ValueError: bad input)"
    # A long message is cut between words, and says so; TensorFlow's
    # decoration of an op's error (function, device, op name) is dropped.
    long = "{{function_node __wrapped__BytepsPushPull_device_/job:localhost/replica:0/task:0/" \
           "device:CPU:0}} " + " ".join(f"word{i}" for i in range(200)) + \
           " [Op:BytepsPushPull] name: "
    monkeypatch.setattr(sys, "last_value", ValueError(long), raising=False)
    reason = basics.leave_reason()
    assert reason.startswith("failed (ValueError: word0 word1 ") and reason.endswith(" ...)")
    words = reason[len("failed (ValueError: "):-len(" ...)")].split(" ")
    assert words == [f"word{i}" for i in range(len(words))]      # whole words only
    assert len(reason) <= messages.MAX_CHARS + len("failed (ValueError: ...)") + 1
    short = "{{function_node f_device_/job:localhost/task:0/device:CPU:0}} push_pull cannot " \
            "complete: worker 1 left [Op:BytepsPushPull] name: "
    monkeypatch.setattr(sys, "last_value", ValueError(short), raising=False)
    assert basics.leave_reason() == "failed (ValueError: push_pull cannot complete: worker 1 left)"


def test_each_phase_boundary_says_what_the_worker_is_doing():
    from bps_tf.strategy import phases
    rows = [(phases.FIT, 10, 3), (phases.EPOCH_END, 3, 0), (phases.EPOCH_END, 9, 1),
            (phases.EVALUATE, -1, -1), (phases.PREDICT, 5, -1)]
    said = [phases.activity([phase, 7, a, b, -1]) for phase, a, b in rows]
    assert said == ["fit, epoch 4 of 10", "fit, epoch 5 of 10",
                    "the end of fit (after epoch 10 of 10)", "evaluate", "predict"]
