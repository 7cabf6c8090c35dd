"""Elastic training (docs/elastic.md), from both faces: one elastic cluster of
3 workers x 2 servers per face runs tests/workers/elastic_keras.py (a Horovod
elastic Keras script, one import changed) or elastic_strategy.py (unchanged
model.fit under BytePSStrategy(elastic=True)): a worker SIGKILLs itself
mid-epoch, the two others go on from the last commit, and the newcomer
bpslaunch starts in its place joins. A fixed 2-worker run resumed from the
same commit gives the reference. The refusals and the launcher's pieces are
checked without a cluster."""
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

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = {"horovod": os.path.join(HERE, "workers", "elastic_keras.py"),
           "strategy": os.path.join(HERE, "workers", "elastic_strategy.py")}


def _tail(proc):
    return f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"


def _load(path):
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def _identical(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def _join_epoch(out):
    """The epoch whose commit admitted the newcomer: the last 2-worker commit."""
    return max(int(os.path.basename(p).split("_")[1][1:])
               for p in glob.glob(os.path.join(out, "commit_e*_n2.npz")))


@pytest.fixture(scope="module", params=sorted(SCRIPTS))
def run(request, tmp_path_factory):
    face = request.param
    out = str(tmp_path_factory.mktemp(f"elastic_{face}"))
    hosts = os.path.join(out, "hosts")
    with open(hosts, "w") as f:
        f.write("localhost:3\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", BYTEPS_TIMEOUT="5")
    env.pop("TF_CONFIG", None)
    cmd = [sys.executable, "-m", "bps_tf.launch", "-np", "3", "--servers", "2",
           "--min-np", "2", "--max-np", "3", "--host-discovery-script", f"cat {hosts}",
           "--discovery-interval", "0.5", "--timeout", "200", sys.executable, SCRIPTS[face], out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=230,
                          cwd=tempfile.gettempdir())
    ref, ref_out = None, os.path.join(out, "reference")
    if proc.returncode == 0:
        os.mkdir(ref_out)
        ref = launch(2, 2, [SCRIPTS[face], ref_out], timeout=150,
                     env={"REF_FROM": os.path.join(out, "commit_e1_n3.npz"), "REF_EPOCH": "1",
                          "REF_UNTIL": str(_join_epoch(out))})
    return face, proc, out, ref, ref_out


def test_a_lost_worker_does_not_stop_the_job(run):
    face, proc, out, _, _ = run
    assert proc.returncode == 0, _tail(proc)
    assert "was killed by signal SIGKILL; elastic: the job goes on with 2 workers" in proc.stderr
    assert "membership epoch 1: lost worker 2" in proc.stdout + proc.stderr, _tail(proc)
    # The two others went on within 10 s of the kill (BYTEPS_TIMEOUT=5 here).
    with open(os.path.join(out, "killed.json")) as f:
        killed = json.load(f)["time"]
    went_on = os.path.join(out, "reset_e1_n2_r{}.json" if face == "horovod" else
                           "epoch_e1_n2.json")
    for rank in ((0, 1) if face == "horovod" else (0,)):
        with open(went_on.format(rank)) as f:
            delay = json.load(f)["time"] - killed
        assert 0 < delay < 10, delay


def test_survivors_resume_from_the_commit(run):
    face, proc, out, _, _ = run
    commit = _load(os.path.join(out, "commit_e1_n3.npz"))
    resumed = ([f"start_e1_n2_r{rank}" for rank in (0, 1)] if face == "horovod" else
               ["commit_e1_n2"])     # rank 0's variables when epoch 1 began again
    for name in resumed:
        assert _identical(_load(os.path.join(out, name + ".npz")), commit), _tail(proc)


def test_two_worker_phase_equals_a_fixed_run_resumed_from_the_commit(run):
    face, proc, out, ref, ref_out = run
    assert proc.returncode == 0, _tail(proc)
    assert ref.returncode == 0, _tail(ref)
    join = _join_epoch(out)
    assert join in (2, 3), join
    want = _load(os.path.join(ref_out, "ref.npz"))
    got = _load(os.path.join(out, f"commit_e{join}_n2.npz"))
    assert _identical(got, want), [float(np.abs(a - b).max()) for a, b in zip(got, want)]


def test_the_newcomer_receives_the_state_and_every_worker_ends_identical(run):
    face, proc, out, _, _ = run
    join = _join_epoch(out)
    commit = _load(os.path.join(out, f"commit_e{join}_n2.npz"))
    starts = ([f"start_e{join}_n3_r{rank}" for rank in range(3)] if face == "horovod" else
              ["newcomer_start"])
    for name in starts:
        assert _identical(_load(os.path.join(out, name + ".npz")), commit), name
    finals = [_load(os.path.join(out, f"final_r{rank}.npz")) for rank in range(3)]
    assert _identical(finals[0], finals[1]) and _identical(finals[0], finals[2])
    assert not _identical(finals[0], commit)     # it trained on after the join
    done = []
    for rank in range(3):
        with open(os.path.join(out, f"done_r{rank}.json")) as f:
            done.append(json.load(f))
    if face == "horovod":
        assert done == [{"size": 3, "epoch": 5}] * 3
    else:   # fit's History: every epoch once; the newcomer's from its join
        assert sorted(d["epochs"] for d in done) == [5 - join, 5, 5], done
        assert all(d["size"] == 3 for d in done), done


def test_state_kept_outside_the_commit_is_refused_with_the_reason(run):
    face, proc, out, _, _ = run
    with open(os.path.join(out, "refusals.json")) as f:
        refusals = json.load(f)
    strategy = {"horovod": "pass BytePSStrategy(elastic=True)",
                "strategy": "elastic training keeps the barrier"}[face]
    assert strategy in refusals["strategy"], refusals
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
