"""bpslaunch's elastic jobs and the scheduler behind them, with Horovod's
elastic contract (docs/elastic.md), on workers without TensorFlow
(tests/workers/elastic_hosts.py: Horovod's elastic loop over numpy, whose
``w`` counts the steps trained, so a lost or doubled step shows).

Hosts are hosts: 127.0.0.1, 127.0.0.2 and localhost are three of them here.
- discovery: hosts added (the running workers hear at once, through
  ``state._host_messages``), then a host removed (its workers leave at the
  next commit, exit 0, no rollback); --reset-limit 2 holds, 1 fails; each
  worker started on its host through --host-exec;
- fixed hosts (-H): a worker fails (exception): its host is blacklisted and
  its other worker leaves with it in the same reset;
- the default launch (no hosts): a SIGKILLed worker is noticed at once (the
  others train again within 3 s), its replacement joins the running job; a
  worker that gets SIGTERM leaves at the next commit; a job whose survivor
  finished while a replacement was starting exits 0.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_runner import TIMEOUT_SCALE  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "elastic_hosts.py")
EPOCH_STEPS = 10


def _launch(tmp, options, script_args, timeout=90):
    logfile, times = os.path.join(tmp, "log"), os.path.join(tmp, "times")
    env = dict(os.environ, BYTEPS_TIMEOUT="30")
    env.pop("TF_CONFIG", None)
    cmd = ([sys.executable, "-m", "bps_tf.launch", "--servers", "1",
            "--timeout", str(int(timeout * TIMEOUT_SCALE))] + options +
           [sys.executable, SCRIPT, "--logfile", logfile, "--times", times] + script_args)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=int(timeout * TIMEOUT_SCALE) + 30, cwd=tempfile.gettempdir())
    rows, events = [], []
    if os.path.exists(logfile):
        with open(logfile) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    if os.path.exists(times):
        with open(times) as f:
            events = [json.loads(line) for line in f if line.strip()]
    return proc, rows, events


def _tail(proc):
    return f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"


def _discovery(tmp, schedule):
    """Hosts by the number of epochs rank 0 logged (as Horovod's tests do)."""
    path = os.path.join(tmp, "hosts.sh")
    logfile = os.path.join(tmp, "log")
    body = [f'n=0; [ -f {logfile} ] && n=$(wc -l < {logfile})']
    for epoch, hosts in schedule[:-1]:
        body.append(f'if [ "$n" -eq {epoch} ]; then printf "%s\\n" {" ".join(hosts)}; exit 0; fi')
    body.append(f'printf "%s\\n" {" ".join(schedule[-1][1])}')
    with open(path, "w") as f:
        f.write("\n".join(body) + "\n")
    return f"bash {path}"


SCHEDULE = [(0, ["127.0.0.1:2"]), (1, ["127.0.0.1:2", "127.0.0.2:2"]), (None, ["127.0.0.2:2"])]


@pytest.fixture(scope="module")
def hosts_job(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("hosts"))
    # Each worker started on its host through --host-exec (`env` runs the
    # command in place, as `ip netns exec` does), the servers at --address.
    return _launch(tmp, ["-np", "2", "--min-num-proc", "2", "--max-num-proc", "4",
                         "--host-discovery-script", _discovery(tmp, SCHEDULE),
                         "--discovery-interval", "0.2", "--reset-limit", "2",
                         "--host-exec", "env BPS_TEST_HOST_EXEC={host}",
                         "--address", "127.0.0.1"],
                   ["--discovery-schedule", json.dumps(SCHEDULE)])


def test_hosts_added_then_removed(hosts_job):
    proc, rows, events = hosts_job
    assert proc.returncode == 0, _tail(proc)
    # Horovod's assertions, with 127.0.0.1 then 127.0.0.2 as the hosts.
    assert [(r["start_rank"], r["size"], r["hostname"]) for r in rows] == \
        [(0, 2, "127.0.0.1"), (0, 4, "127.0.0.1"), (2, 2, "127.0.0.2")], _tail(proc)
    assert rows[2]["rendezvous"] == 3
    # No step lost or trained twice: the leavers left without a rollback.
    assert [r["w"] for r in rows] == [10.0, 20.0, 30.0], rows
    done = [e for e in events if e["event"] == "done"]
    assert sorted((e["start_rank"], e["size"], e["w"]) for e in done) == \
        [(2, 2, 30.0), (3, 2, 30.0)], done


def test_host_exec_starts_each_worker_on_its_host(hosts_job):
    proc, _, events = hosts_job
    done = [e for e in events if e["event"] == "done"]
    assert done and all(e["host_exec"] == e["hostname"] == e["node_host"] == "127.0.0.2"
                        for e in done), done
    assert "on 127.0.0.1: the scheduler on port" in proc.stderr, _tail(proc)


def test_removed_hosts_workers_exit_0_and_are_no_failure(hosts_job):
    proc, _, _ = hosts_job
    end = proc.stderr.strip().splitlines()[-1]
    assert "job finished" in end, _tail(proc)
    for worker in range(4):   # the first two left (removed), the newcomers finished
        assert f"worker {worker} exit 0" in end, end
    assert "leave the job at the next commit" in proc.stderr, _tail(proc)


def test_reset_limit_fails_the_job_naming_the_limit(tmp_path):
    proc, rows, _ = _launch(str(tmp_path), [
        "-np", "2", "--min-num-proc", "2", "--max-num-proc", "4",
        "--host-discovery-script", _discovery(str(tmp_path), SCHEDULE),
        "--discovery-interval", "0.2", "--reset-limit", "1"],
        ["--discovery-schedule", json.dumps(SCHEDULE)])
    assert proc.returncode != 0, _tail(proc)
    assert "the number of resets exceeded the limit of 1" in proc.stderr, _tail(proc)
    assert "job failed" in proc.stderr.strip().splitlines()[-1]
    assert len(rows) == 2, rows    # the first reset (hosts added) was allowed


SIGTERM_PROBE = """
import os, signal, sys
from bps_tf.runtime import basics
basics._handle_sigterm_as_leave()
if sys.argv[1] == "leaving":
    basics.leaving_on_purpose()
    # Ignored by the kernel too: Python puts SIG_DFL back while it finalizes.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN, signal.getsignal(signal.SIGTERM)
os.kill(os.getpid(), signal.SIGTERM)
print("still here", flush=True)
"""


@pytest.mark.parametrize("state,code", [("leaving", 0), ("not_a_member", -signal.SIGTERM)])
def test_a_sigterm_after_the_order_to_leave_does_not_end_the_worker_by_the_signal(state, code):
    # bpslaunch tells the scheduler that a blacklisted host's workers go and
    # sends them SIGTERM at once: a worker the scheduler's order reached first
    # is leaving with exit code 0 and keeps it. The control: a SIGTERM to a
    # worker that is no member ends it as SIGTERM does.
    proc = subprocess.run([sys.executable, "-c", SIGTERM_PROBE, state], capture_output=True,
                          text=True, timeout=60, cwd=tempfile.gettempdir())
    assert proc.returncode == code, proc.stderr
    assert ("still here" in proc.stdout) == (code == 0), proc.stdout


@pytest.fixture(scope="module")
def failure_job(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("failure"))
    return _launch(tmp, ["-np", "2", "--min-np", "2", "-H", "127.0.0.1:2,localhost:2"],
                   ["--exit-schedule", json.dumps({str((1, 0)): [0]}),
                    "--exit-mode", "exception"])


def test_a_failed_workers_host_leaves_with_it(failure_job):
    proc, rows, events = failure_job
    assert proc.returncode == 0, _tail(proc)
    assert [(r["start_rank"], r["size"], r["rendezvous"]) for r in rows] == \
        [(0, 4, 1), (2, 2, 2), (2, 2, 2)], _tail(proc)
    assert [r["hostname"] for r in rows] == ["127.0.0.1", "localhost", "localhost"]
    assert rows[-1]["w"] == 3 * EPOCH_STEPS
    assert "host 127.0.0.1 is blacklisted" in proc.stderr, _tail(proc)
    end = proc.stderr.strip().splitlines()[-1]
    assert "worker 0 exit 1" in end and "worker 1 exit 0" in end, end   # it left


@pytest.fixture(scope="module")
def default_job(tmp_path_factory):
    """The default launch: -np 2 --min-np 1 --max-np 2, no hosts; commits at
    epoch ends. Launch ids: 1 is SIGKILLed at (1, 2); its replacement 2
    joins, then gets SIGTERM at (3, 4) and leaves; 3 replaces it; 3 is
    SIGKILLed at (5, 8), in the last epoch, and its replacement 4 starts too
    slowly to join before the survivor finishes (the end saves without a
    host check, as model.fit's does)."""
    tmp = str(tmp_path_factory.mktemp("default"))
    return _launch(tmp, ["-np", "2", "--min-np", "1", "--max-np", "2"],
                   ["--epochs", "6", "--batch-wait", "0.05", "--batches-per-commit", "1000",
                    "--kill-schedule", json.dumps({str((1, 2)): ["1"], str((5, 8)): ["3"]}),
                    "--term-schedule", json.dumps({str((3, 4)): ["2"]}),
                    "--newcomer-delay", json.dumps({"4": 30}), "--no-final-check"])


def test_default_launch_says_lost_workers_are_replaced(default_job):
    proc, _, _ = default_job
    assert "lost workers are replaced (up to -np 2)" in proc.stderr, _tail(proc)


def test_survivors_train_again_within_3_s_of_a_sigkill(default_job):
    proc, _, events = default_job
    kills = [e for e in events if e["event"] == "kill"]
    assert len(kills) == 2, _tail(proc)
    for kill in kills:
        after = [e["time"] - kill["time"] for e in events
                 if e["event"] == "step" and e["time"] > kill["time"] and e["start_rank"] == 0]
        assert after and min(after) < 3.0, (kill, after, _tail(proc))


def test_replacement_joins_the_running_job(default_job):
    proc, rows, events = default_job
    joined = [e for e in events if e["event"] == "step" and e["launch_id"] in ("2", "3")]
    assert {e["launch_id"] for e in joined} == {"2", "3"}, _tail(proc)
    assert all(e["size"] == 2 and e["rank"] == 1 for e in joined), joined
    assert [r["w"] for r in rows] == [float(EPOCH_STEPS * (e + 1)) for e in range(6)], rows


def test_sigterm_leaves_at_the_next_commit_with_exit_0(default_job):
    proc, _, events = default_job
    term = next(e for e in events if e["event"] == "term")
    assert term["launch_id"] == "2"
    end = proc.stderr.strip().splitlines()[-1]
    assert "worker 2 exit 0" in end, end
    # The survivor went on without a rollback: its next membership starts
    # where the leaver left (not at an earlier commit).
    resumed = [e for e in events if e["event"] == "step" and e["start_rank"] == 0 and
               e["time"] > term["time"]]
    assert resumed and (resumed[0]["epoch"], resumed[0]["batch"]) >= (3, 4), resumed


def test_job_whose_training_finished_exits_0_while_a_replacement_starts(default_job):
    proc, _, events = default_job
    assert proc.returncode == 0, _tail(proc)
    done = [e for e in events if e["event"] == "done"]
    assert [(e["launch_id"], e["w"]) for e in done] == [("0", 60.0)], done
    end = proc.stderr.strip().splitlines()[-1]
    assert "job finished" in end and "worker 4 SIGTERM" in end, end


LEAVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers",
                      "elastic_leaver_pending.py")


def test_a_leaver_still_waiting_when_the_others_restart_fails_at_once_and_exits_0(tmp_path):
    # The others restart after the commit's agreement (an agreed change:
    # nothing of theirs is failed). A worker that leaves at that commit may
    # still wait for an operation of the old epoch; the servers drop what
    # they still had queued for it when the new epoch starts, so only the
    # scheduler's notice can end that wait. Before, it waited until the
    # scheduler was gone (seen as a 2-minute failure of a removed host's job).
    wait_s = 40 * TIMEOUT_SCALE
    proc = subprocess.run(
        [sys.executable, "-m", "bps_tf.launch", "-np", "3", "--servers", "1",
         "--min-np", "2", "--max-np", "3", "--timeout", str(int(90 * TIMEOUT_SCALE)),
         sys.executable, LEAVER, str(tmp_path), str(wait_s)],
        env={k: v for k, v in os.environ.items() if k != "TF_CONFIG"}, capture_output=True,
        text=True, timeout=int(90 * TIMEOUT_SCALE) + 30, cwd=tempfile.gettempdir())
    assert proc.returncode == 0, _tail(proc)
    got = {}
    for launch in ("0", "1", "2"):
        with open(os.path.join(str(tmp_path), f"w{launch}.json")) as f:
            got[launch] = json.load(f)
    assert all(got[w]["first"] == 6.0 for w in got), got
    # bpslaunch starts a replacement for the leaver, which may join the new
    # epoch: every member of it has the sum of its ranks + 1, the leaver's
    # push in none.
    size = got["0"]["size_after"]
    for stayer in ("0", "1"):
        assert got[stayer]["agreed"] == 3.0 and got[stayer]["size_after"] == size, got
        assert got[stayer]["after"] == size * (size + 1) / 2, got
    newcomer = os.path.join(str(tmp_path), "w3.json")
    if size == 3:
        with open(newcomer) as f:
            assert json.load(f)["after"] == 6.0
    else:
        assert size == 2 and not os.path.exists(newcomer), got
    leaver = got["2"]
    assert leaver["asked"] and leaver["leaving"], leaver
    assert "pending" not in leaver, leaver
    assert "the workers changed (membership epoch 1" in leaver["pending_error"], leaver
    assert leaver["pending_s"] < wait_s / 2, leaver
    end = proc.stderr.strip().splitlines()[-1]
    assert "job finished" in end and "worker 2 exit 0" in end, end
