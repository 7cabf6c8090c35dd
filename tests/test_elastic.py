"""Elastic training (docs/elastic.md), from both faces, in one elastic cluster
of 3 workers x 2 servers (tests/workers/elastic_faces.py): phase "a_" is a
Horovod elastic Keras script with one import changed, phase "b_" an
unchanged model.fit under BytePSStrategy(elastic=True). In each, a worker
SIGKILLs itself mid-epoch, the two others go on from the last commit, and
the newcomer bpslaunch starts in its place joins. A fixed 2-worker run
resumed from the same commits gives the references. The refusals and the
launcher's pieces are checked without a cluster."""
import glob
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_runner import launch  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "elastic_faces.py")
PHASES = ("a_", "b_")


def _tail(proc):
    return f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"


def _load(path):
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def _identical(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def _json(out, name):
    with open(os.path.join(out, name + ".json")) as f:
        return json.load(f)


def _join_epoch(out, phase):
    """The epoch whose commit admitted the newcomer: the last 2-worker commit."""
    return max(int(os.path.basename(p)[len(phase):].split("_")[1][1:])
               for p in glob.glob(os.path.join(out, f"{phase}commit_e*_n2.npz")))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("elastic"))
    hosts = os.path.join(out, "hosts")
    with open(hosts, "w") as f:
        f.write("localhost:3\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", BYTEPS_TIMEOUT="4")
    env.pop("TF_CONFIG", None)
    cmd = [sys.executable, "-m", "bps_tf.launch", "-np", "3", "--servers", "2",
           "--min-np", "2", "--max-np", "3", "--host-discovery-script", f"cat {hosts}",
           "--discovery-interval", "0.5", "--timeout", "240", sys.executable, SCRIPT, out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=270,
                          cwd=tempfile.gettempdir())
    ref, ref_out = None, os.path.join(out, "reference")
    if proc.returncode == 0:
        os.mkdir(ref_out)
        ref_env = {"REF": "1"}
        for phase in PHASES:
            key = phase[0].upper()
            ref_env[f"REF_{key}_FROM"] = os.path.join(out, f"{phase}commit_e1_n3.npz")
            ref_env[f"REF_{key}_UNTIL"] = str(_join_epoch(out, phase))
        ref = launch(2, 2, [SCRIPT, ref_out], timeout=150, env=ref_env)
    return proc, out, ref, ref_out


def test_a_lost_worker_does_not_stop_the_job(run):
    proc, out, _, _ = run
    assert proc.returncode == 0, _tail(proc)
    lost = [line for line in proc.stderr.splitlines()
            if "was killed by signal SIGKILL; elastic: the job goes on with 2 workers" in line]
    assert len(lost) == 2, _tail(proc)             # one per phase
    log = proc.stdout + proc.stderr
    assert "membership epoch 1: lost worker 2" in log, _tail(proc)


@pytest.mark.parametrize("phase", PHASES)
def test_the_others_go_on_within_10_s(run, phase):
    _, out, _, _ = run
    killed = _json(out, phase + "killed")["time"]
    went_on = ([f"a_reset_e1_n2_r{rank}" for rank in (0, 1)] if phase == "a_" else
               ["b_epoch_e1_n2"])
    for name in went_on:
        delay = _json(out, name)["time"] - killed
        assert 0 < delay < 10, (name, delay)


@pytest.mark.parametrize("phase", PHASES)
def test_survivors_resume_from_the_commit(run, phase):
    proc, out, _, _ = run
    commit = _load(os.path.join(out, f"{phase}commit_e1_n3.npz"))
    resumed = ([f"a_start_e1_n2_r{rank}" for rank in (0, 1)] if phase == "a_" else
               ["b_commit_e1_n2"])      # rank 0's variables when epoch 1 began again
    for name in resumed:
        assert _identical(_load(os.path.join(out, name + ".npz")), commit), _tail(proc)


@pytest.mark.parametrize("phase", PHASES)
def test_two_worker_phase_equals_a_fixed_run_resumed_from_the_commit(run, phase):
    proc, out, ref, ref_out = run
    assert proc.returncode == 0, _tail(proc)
    assert ref.returncode == 0, _tail(ref)
    join = _join_epoch(out, phase)
    assert join in (2, 3), join
    want = _load(os.path.join(ref_out, f"{phase}ref.npz"))
    got = _load(os.path.join(out, f"{phase}commit_e{join}_n2.npz"))
    assert _identical(got, want), [float(np.abs(a - b).max()) for a, b in zip(got, want)]


@pytest.mark.parametrize("phase", PHASES)
def test_the_newcomer_receives_the_state_and_every_worker_ends_identical(run, phase):
    _, out, _, _ = run
    join = _join_epoch(out, phase)
    commit = _load(os.path.join(out, f"{phase}commit_e{join}_n2.npz"))
    starts = ([f"a_start_e{join}_n3_r{rank}" for rank in range(3)] if phase == "a_" else
              ["b_newcomer_start"])
    for name in starts:
        assert _identical(_load(os.path.join(out, name + ".npz")), commit), name
    finals = [_load(os.path.join(out, f"{phase}final_r{rank}.npz")) for rank in range(3)]
    assert _identical(finals[0], finals[1]) and _identical(finals[0], finals[2])
    assert not _identical(finals[0], commit)     # it trained on after the join
    done = [_json(out, f"{phase}done_r{rank}") for rank in range(3)]
    assert all(d["size"] == 3 for d in done), done
    if phase == "a_":
        assert all(d["epoch"] == 5 for d in done), done
    else:   # fit's History: every epoch once, as trained last (a newcomer's too)
        assert all(d["epochs"] == list(range(5)) for d in done), done


def test_state_kept_outside_the_commit_is_refused_with_the_reason(run):
    _, out, _, _ = run
    refusals = _json(out, "refusals")
    assert "pass BytePSStrategy(elastic=True)" in refusals["strategy"], refusals
    assert "elastic training keeps the barrier" in refusals["strategy_overlap"], refusals
    assert "error-feedback residuals" in refusals["compression"], refusals
    assert "OverlappedApply under elastic training" in refusals["overlap"], refusals


# ------------------------------------------------------------ without a cluster

def test_discovery_lines_and_worker_counts():
    from bps_tf.launch import elastic
    local = elastic.local_names()
    assert elastic.parse_discovery("localhost:2\n# note\n\n127.0.0.1\n", local) == \
        {"localhost": 2, "127.0.0.1": 1}
    with pytest.raises(ValueError, match="'other-host' is not this machine"):
        elastic.parse_discovery("other-host:4", local)
    with pytest.raises(ValueError, match="expected host:slots"):
        elastic.parse_discovery("localhost:two", local)
    assert elastic.check_options(3, 2, 4) == (3, 2, 4)
    assert elastic.check_options(None, 2, None) == (2, 2, 2)
    with pytest.raises(ValueError, match="--min-np"):
        elastic.check_options(1, 2, 3)
    with pytest.raises(ValueError, match="at most 64"):
        elastic.check_options(2, 1, 65)


def test_elastic_refuses_what_it_cannot_make_exact():
    from bps_tf.runtime import config
    with pytest.raises(ValueError, match="asynchronous training"):
        config.check_elastic({"async": 1, "local_reduce": 0})
    with pytest.raises(ValueError, match="BYTEPS_LOCAL_REDUCE=1"):
        config.check_elastic({"async": 0, "local_reduce": 1})
    values = config.core_settings({"BYTEPS_ELASTIC": "1"})
    assert values["elastic"] == 1 and values["local_reduce"] == 0
    assert config.core_settings({})["local_reduce"] == -1   # unchanged without elastic


def test_launcher_refuses_inconsistent_elastic_options():
    proc = subprocess.run([sys.executable, "-m", "bps_tf.launch", "-np", "1", "--min-np", "2",
                           "--servers", "1", "true"], capture_output=True, text=True,
                          timeout=60, cwd=tempfile.gettempdir())
    assert proc.returncode == 2 and "--min-np (2) <= -np (1)" in proc.stderr, proc.stderr


class _FakeChild:
    def __init__(self, name, kind, returncode=None):
        self.name, self.kind, self.returncode, self.pid = name, kind, returncode, id(self)

    def label(self):
        return self.name

    def exit_text(self):
        return f"exited with code {self.returncode}"


class _FakeJob:
    """The Job API supervise_elastic uses, driven by a script of exits."""

    def __init__(self, exits):
        self.children = [_FakeChild("server 0", "server"), _FakeChild("worker 0", "worker"),
                         _FakeChild("worker 1", "worker")]
        self.exits = list(exits)     # per poll: names that exit now, with their codes
        self.started = []

    def check(self, deadline, timeout):
        if self.exits:
            for name, code in self.exits.pop(0):
                next(c for c in self.children if c.name == name).returncode = code

    def newly_exited(self, seen):
        fresh = [c for c in self.children if c.returncode is not None and c.pid not in seen]
        seen.update(c.pid for c in fresh)
        return fresh

    def running(self, kind=None):
        return [c for c in self.children if c.returncode is None and kind in (None, c.kind)]

    def stop(self, children=None):
        for c in children or self.children:
            c.returncode = -15

    def start_worker(self, newcomer):
        child = _FakeChild(f"worker {len(self.children) - 1}", "worker")
        self.children.append(child)
        self.started.append(child.name)


def test_launcher_replaces_failed_workers_until_the_host_is_blacklisted(monkeypatch, capsys):
    from bps_tf.launch import elastic, procs
    monkeypatch.setattr(elastic, "POLL_INTERVAL_S", 0)
    # worker 1 fails, its replacement (worker 2) fails, then worker 0: with
    # --blacklist-after 2 only the first failure is replaced.
    job = _FakeJob([[("worker 1", 1)], [], [("worker 2", 1)], [], [("worker 0", 1)], [], []])
    discovery = elastic.Discovery(None, 2, 0.0)
    with pytest.raises(procs.Stop):
        elastic.supervise_elastic(job, job.start_worker, min_np=1, max_np=2,
                                  discovery=discovery, blacklist_after=2, deadline=None,
                                  timeout=None, shutdown_timeout=1)
    err = capsys.readouterr().err
    assert job.started == ["worker 2"], job.started
    assert "failed 2 times (--blacklist-after 2): it is blacklisted" in err, err
    assert "every worker is gone" in err, err


def test_launcher_ends_an_elastic_job_when_its_workers_finish(monkeypatch):
    from bps_tf.launch import elastic
    monkeypatch.setattr(elastic, "POLL_INTERVAL_S", 0)
    job = _FakeJob([[("worker 0", 0), ("worker 1", 0)], [("server 0", 0)]])
    code = elastic.supervise_elastic(job, job.start_worker, min_np=1, max_np=3,
                                     discovery=elastic.Discovery(None, 3, 0.0),
                                     blacklist_after=3, deadline=None, timeout=None,
                                     shutdown_timeout=1)
    assert code == 0 and job.started == []   # nobody new starts once the job is finishing
