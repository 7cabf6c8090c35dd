"""bpslaunch with fake workers and a fake server: environment, failures, cleanup.

The fake server plays the real one's part in the launch protocol: server 0
binds a free port on 127.0.0.1 and writes it to BYTEPS_READY_FILE atomically;
every server exits 0 once each worker has left a ``done-<rank>`` file (the
real scheduler tells the servers when the workers are finished).
Every process records its pid (and a grandchild's) so the tests can check that
nothing outlives the launcher.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bps_tf.launch import environments, launcher

REPO = Path(__file__).resolve().parent.parent

FAKE_SERVER = r'''
import glob, json, os, signal, socket, subprocess, sys, time
out, modes = sys.argv[1], set(sys.argv[2].split(","))
env = dict(os.environ)
sid = env.get("BYTEPS_SERVER_ID", "x")
if "ignore-term" in modes:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
record = {"pid": os.getpid(), "grandchild": grandchild.pid, "env": env}
with open(os.path.join(out, f"server-{sid}.json.tmp"), "w") as f:
    json.dump(record, f)
os.replace(os.path.join(out, f"server-{sid}.json.tmp"), os.path.join(out, f"server-{sid}.json"))
if "exit-before-ready" in modes:
    sys.exit(2)
if env.get("BYTEPS_HOST_SCHEDULER") == "1":
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    ready = env["BYTEPS_READY_FILE"]
    with open(ready + ".tmp", "w") as f:
        f.write(str(sock.getsockname()[1]))
    os.replace(ready + ".tmp", ready)
if "die-after-ready" in modes:
    time.sleep(0.2)
    sys.exit(5)
if "leave-early" in modes:
    time.sleep(0.2)
    sys.exit(0)
workers = int(env.get("DMLC_NUM_WORKER", "1"))
while "never-exit" in modes or len(glob.glob(os.path.join(out, "done-*"))) < workers:
    time.sleep(0.02)
'''

FAKE_WORKER = r'''
import glob, json, os, signal, subprocess, sys, time
out, plan = sys.argv[1], json.loads(sys.argv[2])
env = dict(os.environ)
rank = env.get("DMLC_WORKER_ID", "0")
action = plan.get(rank, "ok")
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
record = {"pid": os.getpid(), "grandchild": grandchild.pid, "env": env}
with open(os.path.join(out, f"worker-{rank}.json.tmp"), "w") as f:
    json.dump(record, f)
os.replace(os.path.join(out, f"worker-{rank}.json.tmp"), os.path.join(out, f"worker-{rank}.json"))
if action == "ok":
    open(os.path.join(out, f"done-{rank}"), "w").close()
    sys.exit(0)
if action == "hang":
    time.sleep(60)
# A failing worker waits until every process has recorded itself, so the
# test knows every pid that must be gone afterwards.
expected = int(env.get("DMLC_NUM_WORKER", "1")) + int(env.get("DMLC_NUM_SERVER", "0"))
give_up = time.time() + 10
while len(glob.glob(os.path.join(out, "*.json"))) < expected and time.time() < give_up:
    time.sleep(0.02)
if action.startswith("exit:"):
    sys.exit(int(action[5:]))
if action == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
'''


@pytest.fixture
def job(tmp_path):
    """Paths and commands for one fake job, and a check that nothing it started survives."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "server.py").write_text(FAKE_SERVER)
    (tmp_path / "worker.py").write_text(FAKE_WORKER)

    class Job:
        dir = out

        @staticmethod
        def server(mode="normal"):
            return [sys.executable, str(tmp_path / "server.py"), str(out), mode]

        @staticmethod
        def worker(plan=None):
            return [sys.executable, str(tmp_path / "worker.py"), str(out), json.dumps(plan or {})]

        @staticmethod
        def records(kind):
            return {p.name.split("-", 1)[1][:-5]: json.loads(p.read_text())
                    for p in out.glob(f"{kind}-*.json")}

        @staticmethod
        def pids():
            recs = list(Job.records("worker").values()) + list(Job.records("server").values())
            return [r["pid"] for r in recs] + [r["grandchild"] for r in recs]

    yield Job
    for pid in Job.pids():     # never leave a stray process behind, whatever the test did
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def assert_all_gone(pids, within=3.0):
    # Killed grandchildren are reaped by init, which may take a moment.
    give_up = time.monotonic() + within
    while time.monotonic() < give_up and not all(gone(p) for p in pids):
        time.sleep(0.02)
    assert [p for p in pids if not gone(p)] == []


def run(job, np_, servers, plan=None, server_mode="normal", **kwargs):
    kwargs.setdefault("timeout", 20)
    kwargs.setdefault("grace", 1)
    start = time.monotonic()
    code = launcher.run_local(np_, servers, job.worker(plan),
                              server_command=job.server(server_mode), **kwargs)
    return code, time.monotonic() - start


# ------------------------------------------------------------------ local mode

def test_every_child_gets_its_place(job, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {}}')
    monkeypatch.setenv("BYTEPS_SERVER_ID", "7")          # stale values must not leak in
    monkeypatch.setenv("HOROVOD_RANK", "9")
    monkeypatch.delenv("BYTEPS_JOB_TOKEN", raising=False)
    code, _ = run(job, 3, 2)
    assert code == 0
    workers, servers = job.records("worker"), job.records("server")
    assert sorted(workers) == ["0", "1", "2"] and sorted(servers) == ["0", "1"]

    port = servers["1"]["env"]["DMLC_PS_ROOT_PORT"]
    assert port != "0"
    tokens = set()
    for rank, rec in workers.items():
        env = rec["env"]
        assert (env["DMLC_ROLE"], env["DMLC_WORKER_ID"], env["BYTEPS_LOCAL_RANK"]) == ("worker", rank, rank)
        assert (env["BYTEPS_LOCAL_SIZE"], env["DMLC_NUM_WORKER"], env["DMLC_NUM_SERVER"]) == ("3", "3", "2")
        assert (env["DMLC_PS_ROOT_URI"], env["DMLC_PS_ROOT_PORT"]) == ("127.0.0.1", port)
        assert "TF_CONFIG" not in env and "BYTEPS_SERVER_ID" not in env
        assert (env["HOROVOD_RANK"], env["HOROVOD_SIZE"], env["HOROVOD_LOCAL_RANK"],
                env["HOROVOD_LOCAL_SIZE"]) == (rank, "3", rank, "3")   # as horovodrun's
        tokens.add(env["BYTEPS_JOB_TOKEN"])
    s0, s1 = servers["0"]["env"], servers["1"]["env"]
    assert (s0["DMLC_ROLE"], s0["BYTEPS_SERVER_ID"], s0["BYTEPS_HOST_SCHEDULER"]) == ("server", "0", "1")
    assert (s0["DMLC_PS_ROOT_PORT"], s0["BYTEPS_SERVER_PORT"], s0["BYTEPS_BIND_HOST"]) == ("0", "0", "127.0.0.1")
    assert s0["BYTEPS_READY_FILE"].endswith("scheduler.port") and s0["DMLC_NODE_HOST"] == "127.0.0.1"
    assert (s1["BYTEPS_SERVER_ID"], s1["BYTEPS_HOST_SCHEDULER"]) == ("1", "0")
    assert "BYTEPS_READY_FILE" not in s1 and "TF_CONFIG" not in s0
    tokens.update({s0["BYTEPS_JOB_TOKEN"], s1["BYTEPS_JOB_TOKEN"]})
    assert len(tokens) == 1 and len(tokens.pop()) == 32
    # The temporary directory holding the ready file is removed.
    assert not Path(s0["BYTEPS_READY_FILE"]).parent.exists()
    # Grandchildren left behind by successful workers are cleaned up too.
    assert_all_gone(job.pids())


def test_children_get_quiet_tensorflow_unbuffered_python_and_health_ports(job, monkeypatch):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    monkeypatch.setenv("BYTEPS_HEALTH_PORT", "9000")
    assert run(job, 2, 2, prefix_output=True)[0] == 0
    workers, servers = job.records("worker"), job.records("server")
    for rec in list(workers.values()) + list(servers.values()):
        assert rec["env"]["TF_CPP_MIN_LOG_LEVEL"] == "2"
        assert rec["env"]["PYTHONUNBUFFERED"] == "1"
    assert [servers[i]["env"]["BYTEPS_HEALTH_PORT"] for i in ("0", "1")] == ["9000", "9001"]
    assert not any("BYTEPS_HEALTH_PORT" in r["env"] for r in workers.values())
    assert_all_gone(job.pids())


def test_a_chosen_tensorflow_log_level_is_kept_and_health_is_off_by_default(job, monkeypatch):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    monkeypatch.delenv("BYTEPS_HEALTH_PORT", raising=False)
    assert run(job, 2, 1)[0] == 0
    assert job.records("worker")["0"]["env"]["TF_CPP_MIN_LOG_LEVEL"] == "0"
    assert job.records("server")["0"]["env"]["BYTEPS_HEALTH_PORT"] == "0"
    assert run(job, 2, 1, health_port=7000)[0] == 0
    assert job.records("server")["0"]["env"]["BYTEPS_HEALTH_PORT"] == "7000"


def test_prefixed_output_and_a_failure_leave_nothing_behind(job, capfd):
    # Grandchildren hold the pipes open: stopping their groups must still end
    # the output copying.
    code, took = run(job, 3, 1, plan={"0": "hang", "1": "exit:3", "2": "hang"},
                     prefix_output=True)
    assert code == 3 and took < 10
    err = capfd.readouterr().err
    assert "worker 1 exit 3" in err.splitlines()[-1]
    assert_all_gone(job.pids())


def test_job_token_is_kept_when_given(job, monkeypatch):
    monkeypatch.setenv("BYTEPS_JOB_TOKEN", "abc123")
    assert run(job, 2, 1)[0] == 0
    assert {r["env"]["BYTEPS_JOB_TOKEN"] for r in job.records("worker").values()} == {"abc123"}


def test_first_failed_worker_stops_the_others(job, capsys):
    code, took = run(job, 3, 2, plan={"0": "hang", "1": "exit:3", "2": "hang"})
    assert code == 3
    pid = job.records("worker")["1"]["pid"]
    err = capsys.readouterr().err
    assert f"bpslaunch: worker 1 (pid {pid}) exited with code 3; stopping the other processes" in err
    assert took < 10
    assert_all_gone(job.pids())
    assert len(job.pids()) == 10


def test_worker_killed_by_a_signal(job, capsys):
    code, _ = run(job, 2, 1, plan={"0": "kill", "1": "hang"})
    assert code == 1
    pid = job.records("worker")["0"]["pid"]
    assert f"worker 0 (pid {pid}) was killed by signal SIGKILL" in capsys.readouterr().err
    assert_all_gone(job.pids())


def test_timeout_stops_the_whole_job(job, capsys):
    code, took = run(job, 2, 1, plan={"0": "hang", "1": "hang"}, timeout=1.5)
    assert code == launcher.EXIT_TIMEOUT
    assert took < 6
    assert "did not finish within --timeout 1.5 s" in capsys.readouterr().err
    assert_all_gone(job.pids())


def test_server_failure_stops_the_workers(job, capsys):
    code, _ = run(job, 2, 1, plan={"0": "hang", "1": "hang"}, server_mode="die-after-ready")
    assert code == 5
    assert "server 0 (pid" in capsys.readouterr().err
    assert_all_gone(job.pids())


def test_server_leaving_while_workers_run_fails_after_the_shutdown_timeout(job, capsys):
    code, took = run(job, 2, 1, plan={"0": "hang", "1": "hang"}, server_mode="leave-early",
                     shutdown_timeout=0.5)
    assert code == 1 and took < 6
    assert "exited while workers were still running" in capsys.readouterr().err
    assert_all_gone(job.pids())


def test_server_failing_before_ready_fails_at_once(job, capsys):
    code, took = run(job, 2, 1, server_mode="exit-before-ready")
    assert code == 2 and took < 5
    assert "before it reported the scheduler port" in capsys.readouterr().err
    assert job.records("worker") == {}
    assert_all_gone(job.pids())


def test_server_never_ready(job, capsys):
    silent = [sys.executable, "-c", "import time; time.sleep(60)"]
    start = time.monotonic()
    code = launcher.run_local(2, 1, job.worker(), server_command=silent, ready_timeout=0.5, grace=1)
    assert code == 1 and time.monotonic() - start < 5
    assert "did not write the scheduler port" in capsys.readouterr().err


def test_stuck_servers_are_killed_after_the_workers_succeed(job, capsys):
    # The server ignores SIGTERM too, so only the SIGKILL after the grace period ends it.
    code, took = run(job, 2, 2, server_mode="never-exit,ignore-term", shutdown_timeout=0.3,
                     grace=0.3)
    assert code == 0 and took < 5
    err = capsys.readouterr().err
    assert "did not exit within 0.3 s after all workers finished" in err
    assert "server 0 (pid" in err and "server 1 (pid" in err
    assert_all_gone(job.pids())


@pytest.mark.parametrize("prefix", [False, True])
def test_sigterm_to_the_launcher_stops_everything(job, prefix):
    script = (f"import sys; from bps_tf.launch import launcher; sys.exit(launcher.run_local("
              f"2, 1, {job.worker({'0': 'hang', '1': 'hang'})!r}, "
              f"server_command={job.server('ignore-term')!r}, grace=0.5, "
              f"prefix_output={prefix}))")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        give_up = time.monotonic() + 10
        while len(job.records("worker")) + len(job.records("server")) < 3:
            assert time.monotonic() < give_up and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_all_gone(job.pids())


def test_one_worker_without_servers_runs_the_command_alone(job, monkeypatch, capsys):
    monkeypatch.setenv("DMLC_ROLE", "worker")
    code, _ = run(job, 1, 0, plan={"0": "exit:4"})
    assert code == 4
    assert "worker 0 (pid" in capsys.readouterr().err
    assert "DMLC_ROLE" not in job.records("worker")["0"]["env"]
    assert_all_gone(job.pids())


def test_cannot_start_the_command(job, capsys):
    code = launcher.run_local(2, 1, ["/nonexistent/program"], server_command=job.server(),
                              grace=0.5, timeout=20)
    assert code == launcher.EXIT_CANNOT_START
    assert "cannot start worker 0" in capsys.readouterr().err
    assert_all_gone(job.pids())


# ------------------------------------------------------------------------- CLI

@pytest.mark.parametrize("argv, needle", [
    (["-np", "0", "python"], "must be at least 1"),
    (["-np", "2", "--servers", "0", "python"], "at least one server"),
    (["-np", "2"], "no command"),
    (["--servers", "2", "python"], "only applies with -np"),
    (["--timeout", "-1", "-np", "1", "python"], "must be more than 0"),
    (["--shutdown-timeout", "0", "-np", "1", "python"], "must be more than 0"),
    (["--shutdown-timeout", "60", "python"], "only applies with -np"),
    (["-np", "two", "python"], "expected a number, got 'two'"),
    (["-np", "2", "--health-port", "70000", "python"], "at most 65535"),
    (["-np", "2", "-H", "a:2", "--host-exec", "env X={host}", "python"], "needs --address"),
    (["-np", "2", "-H", "a:2", "--host-exec", "env", "--address", "127.0.0.1", "python"],
     "does not name the host"),
    (["-np", "2", "--address", "127.0.0.1", "python"], "applies with --host-exec only"),
    (["-np", "2", "--host-exec", "env X={host}", "--address", "127.0.0.1", "python"],
     "give the hosts"),
    (["--host-exec", "env X={host}", "--address", "127.0.0.1", "python"],
     "only applies with -np"),
])
def test_cli_usage_errors(argv, needle, capsys):
    assert launcher.main(argv) == launcher.EXIT_USAGE
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv, want", [
    ([], launcher.DEFAULT_SHUTDOWN_TIMEOUT_S), (["--shutdown-timeout", "7.5"], 7.5)])
def test_the_shutdown_timeout_reaches_the_supervisor(monkeypatch, argv, want):
    seen = {}
    monkeypatch.setattr(launcher, "run_local",
                        lambda *args, **kwargs: seen.update(kwargs) or 0)
    assert launcher.main(["-np", "2", *argv, "python", "x.py"]) == 0
    assert seen["shutdown_timeout"] == want


def test_ignored_signals_stay_ignored():
    # Under nohup SIGHUP is ignored; the launcher must not turn it into a stop.
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    before = signal.getsignal(signal.SIGTERM)
    try:
        with launcher.catch_stop_signals(launcher.Job(grace_s=0)):
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) != before
        assert signal.getsignal(signal.SIGTERM) == before
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_cli_parsing_keeps_the_command_intact():
    args = launcher.parse_args(["-np", "2", "-ns", "3", "--timeout", "5", "--", "python",
                                "train.py", "-np", "9", "--verbose"])
    assert (args.num_proc, args.servers, args.timeout, args.verbose) == (2, 3, 5.0, False)
    assert args.command == ["python", "train.py", "-np", "9", "--verbose"]
    assert launcher.parse_args(["--num-proc", "1", "prog"]).command == ["prog"]


def test_cli_as_a_module(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in environments.PLACEMENT_VARIABLES}
    env["PYTHONPATH"] = str(REPO)
    check = "import os, sys; sys.exit(7 if 'DMLC_ROLE' not in os.environ else 9)"
    done = subprocess.run([sys.executable, "-m", "bps_tf.launch", "-np", "1", "--",
                           sys.executable, "-c", check], env=dict(env, DMLC_ROLE="worker"),
                          cwd=tmp_path, timeout=20)
    assert done.returncode == 7
    done = subprocess.run([sys.executable, "-m", "bps_tf.launch", sys.executable, "-c", "1"],
                          env=env, cwd=tmp_path, timeout=20, capture_output=True, text=True)
    assert done.returncode == launcher.EXIT_USAGE and "pass -np N" in done.stderr


# ----------------------------------------------------------------- cluster mode

TF_CLUSTER = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}


def tf_env(task_type, index=0):
    env = {k: v for k, v in os.environ.items() if k not in environments.PLACEMENT_VARIABLES}
    env["TF_CONFIG"] = json.dumps({"cluster": TF_CLUSTER, "task": {"type": task_type, "index": index}})
    return env


def test_cluster_mode_worker_runs_the_command(job):
    env = tf_env("worker", 0)
    code = launcher.run_cluster(job.worker({"0": "exit:6"}), server_command=job.server(),
                                environ=env, timeout=20, grace=0.5)
    assert code == 6                      # the child's code, passed on
    rec = job.records("worker")["0"]
    assert rec["env"]["TF_CONFIG"] == env["TF_CONFIG"]      # passed through untouched
    assert job.records("server") == {}
    assert_all_gone(job.pids())


def test_cluster_mode_ps_runs_the_server_and_ignores_the_command(job):
    code = launcher.run_cluster(job.worker(), server_command=job.server("die-after-ready"),
                                environ=tf_env("ps"), timeout=20, grace=0.5)
    assert code == 5
    assert list(job.records("server")) == ["x"] and job.records("worker") == {}
    assert_all_gone(job.pids())


def test_cluster_mode_evaluator_runs_the_command(job):
    code = launcher.run_cluster(job.worker(), server_command=job.server(),
                                environ=tf_env("evaluator"), timeout=20)
    assert code == 0 and list(job.records("worker")) == ["0"]


def test_cluster_mode_dmlc_scheduler_runs_the_server(job):
    env = {k: v for k, v in os.environ.items() if k not in environments.PLACEMENT_VARIABLES}
    env.update({"DMLC_ROLE": "scheduler", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
                "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "0",
                "BYTEPS_READY_FILE": str(job.dir / "port")})
    code = launcher.run_cluster([], server_command=job.server("leave-early"), environ=env, timeout=20)
    assert code == 0 and "x" in job.records("server")


def test_cluster_mode_timeout_and_bad_config(job, capsys):
    code = launcher.run_cluster(job.worker({"0": "hang"}), environ=tf_env("worker", 0),
                                timeout=1, grace=0.5)
    assert code == launcher.EXIT_TIMEOUT
    assert_all_gone(job.pids())
    bad = dict(tf_env("worker"), TF_CONFIG='{"cluster": ')
    assert launcher.run_cluster(["x"], environ=bad) == launcher.EXIT_USAGE
    assert launcher.run_cluster(["x"], environ=tf_env("scheduler")) == launcher.EXIT_USAGE
    err = capsys.readouterr().err
    assert "not valid JSON" in err and "'scheduler'" in err
