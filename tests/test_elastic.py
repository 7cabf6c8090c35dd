"""Elastic training (docs/elastic.md), from both faces, in one elastic cluster
of 3 workers x 2 servers (tests/workers/elastic_faces.py): phase "a_" is a
Horovod elastic Keras script with one import changed, phase "b_" an
unchanged model.fit under BytePSStrategy(elastic=True). In each, a worker
SIGKILLs itself mid-epoch, the two others go on from the last commit, and
the newcomer bpslaunch starts in its place joins at the next commit. A fixed 2-worker run
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
from cluster_runner import TIMEOUT_SCALE, launch  # noqa: E402
from saved_arrays import load as _load, identical as _identical  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "elastic_faces.py")
PHASES = ("a_", "b_")


def _tail(proc):
    return f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"


def _json(out, name):
    with open(os.path.join(out, name + ".json")) as f:
        return json.load(f)


def _join_epoch(out, phase):
    """The epoch whose commit admitted the newcomer: the last 2-worker commit
    (phase B has none: see test_the_strategys_newcomer_joins_at_the_first_commit)."""
    found = [int(os.path.basename(p)[len(phase):].split("_")[1][1:])
             for p in glob.glob(os.path.join(out, f"{phase}commit_e*_n2.npz"))]
    return max(found) if found else 1


def _join_commit(out, phase):
    join = _join_epoch(out, phase)
    size = 2 if os.path.exists(os.path.join(out, f"{phase}commit_e{join}_n2.npz")) else 3
    return _load(os.path.join(out, f"{phase}commit_e{join}_n{size}.npz"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("elastic"))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    # The default launch: bpslaunch replaces a lost worker, and tells the
    # scheduler of the loss at once (no BYTEPS_TIMEOUT to wait).
    limit = int(120 * TIMEOUT_SCALE)
    cmd = [sys.executable, "-m", "bps_tf.launch", "-np", "3", "--servers", "2",
           "--min-np", "2", "--max-np", "3", "--timeout", str(limit), sys.executable, SCRIPT, out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit + 30,
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


def test_the_others_go_on_within_10_s(run):
    _, out, _, _ = run
    killed = _json(out, "a_killed")["time"]
    for name in [f"a_reset_e1_n2_r{rank}" for rank in (0, 1)]:
        delay = _json(out, name)["time"] - killed
        assert 0 < delay < 10, (name, delay)


def test_survivors_resume_from_the_commit(run):
    proc, out, _, _ = run
    commit = _load(os.path.join(out, "a_commit_e1_n3.npz"))
    for name in [f"a_start_e1_n2_r{rank}" for rank in (0, 1)]:
        assert _identical(_load(os.path.join(out, name + ".npz")), commit), _tail(proc)


def test_the_strategys_newcomer_joins_at_the_first_commit_after_the_rollback(run):
    """Phase B: bpslaunch announces the replacement as it sees the SIGKILL,
    so the elastic fit admits it at the first commit after the rollback
    (epoch 1's again): no epoch is trained by 2 workers, and the survivors
    went back to the commit (every worker, the newcomer too, begins epoch 1
    from it; the newcomer's start is checked below)."""
    proc, out, _, _ = run
    log = proc.stdout + proc.stderr
    assert not glob.glob(os.path.join(out, "b_epoch_e*_n2.json")), sorted(os.listdir(out))
    for rank in (0, 1):
        assert (f"[worker {rank}] " in log and "elastic fit: the workers changed; back to the "
                "commit of epoch 1" in log), _tail(proc)
    assert log.count("elastic fit: workers wait to join; going on with them") >= 2, _tail(proc)


def test_two_worker_phase_equals_a_fixed_run_resumed_from_the_commit(run):
    phase = "a_"
    proc, out, ref, ref_out = run
    assert proc.returncode == 0, _tail(proc)
    assert ref.returncode == 0, _tail(ref)
    join = _join_epoch(out, phase)
    assert join == 2, join    # the replacement joins at the first commit after the change
    want = _load(os.path.join(ref_out, f"{phase}ref.npz"))
    got = _load(os.path.join(out, f"{phase}commit_e{join}_n2.npz"))
    assert _identical(got, want), [float(np.abs(a - b).max()) for a, b in zip(got, want)]


@pytest.mark.parametrize("phase", PHASES)
def test_the_newcomer_receives_the_state_and_every_worker_ends_identical(run, phase):
    _, out, _, _ = run
    join = _join_epoch(out, phase)
    commit = _join_commit(out, phase)
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

def test_hosts_lines_slots_and_horovods_rank_plan():
    from bps_tf.launch import elastic, hosts
    local = hosts.local_names()
    assert hosts.parse_hosts("localhost:2\n# note\n\n127.0.0.1\n127.0.0.2:3", local) == \
        {"localhost": 2, "127.0.0.1": 1, "127.0.0.2": 3}
    assert hosts.parse_hosts("localhost:2,127.0.0.1:2", local) == {"localhost": 2, "127.0.0.1": 2}
    with pytest.raises(ValueError, match="'other-host' is not this machine"):
        hosts.parse_hosts("other-host:4", local)
    with pytest.raises(ValueError, match="expected host:slots"):
        hosts.parse_hosts("localhost:two", local)
    # --host-exec: any host, each worker started through the prefix on its own.
    assert hosts.parse_hosts("other-host:4", None) == {"other-host": 4}
    run_on = hosts.check_host_exec("ip netns exec 'ns {host}'", "10.0.0.1")
    assert run_on.argv("h1", ["python", "x.py"]) == \
        ["ip", "netns", "exec", "ns h1", "python", "x.py"]
    assert hosts.check_host_exec(None, None).argv("h1", ["python"]) == ["python"]
    # Horovod's assignment: host by host, up to --max-np; cross ranks per local rank.
    plan = hosts.plan([("a", 2), ("b", 2)], 3)
    assert [(s.host, s.local_rank, s.rank, s.size, s.local_size, s.cross_rank, s.cross_size)
            for s in plan] == [("a", 0, 0, 3, 2, 0, 2), ("a", 1, 1, 3, 2, 0, 1),
                               ("b", 0, 2, 3, 1, 1, 2)]
    assert elastic.check_options(3, 2, 4) == (3, 2, 4)
    assert elastic.check_options(None, 2, None) == (2, 2, 2)
    assert elastic.check_options(2, 2, None, hosts_mode=True) == (2, 2, elastic.MAX_WORKERS)
    with pytest.raises(ValueError, match="--min-np"):
        elastic.check_options(1, 2, 3)
    # No cap below the worker counts the engine handles (docs/scaling.md).
    assert elastic.check_options(2, 1, 1024) == (2, 1, 1024)


def test_blacklisted_hosts_come_back_after_a_growing_cooldown():
    from bps_tf.launch import hosts
    pool = hosts.HostPool({"127.0.0.1": 2, "127.0.0.2": 2}, None, 1, 1.0, cooldown=(1, 2))
    pool.blacklist("127.0.0.1", 100.0, "a test")
    assert pool.available(100.5) == [("127.0.0.2", 2)]
    assert pool.blacklisted("127.0.0.1", 101.9)     # the first cooldown: 2 s (clamped)
    assert pool.available(102.1) == [("127.0.0.1", 2), ("127.0.0.2", 2)]
    forever = hosts.HostPool({"127.0.0.1": 1}, None, 1, 1.0)
    forever.blacklist("127.0.0.1", 0.0, "a test")
    assert forever.listed_all_blacklisted(1e9)
    with pytest.raises(ValueError, match="--blacklist-cooldown-range"):
        hosts.check_cooldown([5, 2])


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
