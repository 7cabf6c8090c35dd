"""No single point of failure under an unchanged elastic model.fit
(docs/elastic.md): 2 workers and 2 servers under bpslaunch, the scheduler in
its own process. Mid-epoch a server is SIGKILLed (training goes on with the
other, and the replacement bpslaunch starts joins), then the scheduler is
SIGKILLed (bpslaunch starts it again; the job goes on once it is back), then
a worker gets SIGTERM (it leaves at the next commit, exit 0, no step redone).
The rolled-back epochs are compared bit for bit with an uninterrupted fixed
2-worker run, the epoch trained alone with one process on the global batch,
and every epoch with one process on the global batch
(tests/workers/elastic_spof_fit.py)."""
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

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "elastic_spof_fit.py")
EPOCHS = 6
STEPS = 10   # 240 rows, global batch 24


def _tail(proc):
    return f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("spof_fit"))
    with open(os.path.join(out, "hosts"), "w") as f:
        f.write("localhost:2\n")
    # BYTEPS_TIMEOUT bounds what nothing else notices (no loss here waits for it);
    # a restart on a loaded machine may take several seconds.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", BYTEPS_TIMEOUT="10")
    env.pop("TF_CONFIG", None)
    limit = int(240 * TIMEOUT_SCALE)
    cmd = [sys.executable, "-m", "bps_tf.launch", "-np", "2", "--servers", "2", "--min-np", "1",
           "--max-np", "2", "--host-discovery-script", f"cat {os.path.join(out, 'hosts')}",
           "--discovery-interval", "0.5", "--timeout", str(limit), sys.executable, SCRIPT, out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit + 60,
                          cwd=tempfile.gettempdir())
    ref, ref_out = None, os.path.join(out, "reference")
    if proc.returncode == 0:
        os.mkdir(ref_out)
        ref = launch(2, 1, [SCRIPT, ref_out], timeout=150, env={"REF": "1"})
    return proc, out, ref, ref_out


def _done(out):
    with open(os.path.join(out, "e_done_r0.json")) as f:
        return json.load(f)


def test_the_job_survives_a_lost_server_a_lost_scheduler_and_a_leaving_worker(run):
    proc, out, _, _ = run
    assert proc.returncode == 0, _tail(proc)
    err = proc.stderr
    assert "replaces it and joins at the workers' next commit" in err, _tail(proc)
    assert "the workers and servers re-register and go on from their last commit" in err, \
        _tail(proc)
    log = proc.stdout + err
    assert "lost server 1" in log and "the scheduler restarted" in log, _tail(proc)
    # the end line: every process ended, the leaving worker with exit 0
    end = [line for line in err.splitlines() if "worker 1 exit" in line]
    assert end and "worker 1 exit 0" in end[-1], _tail(proc)
    done = _done(out)
    assert done["epochs"] == list(range(EPOCHS)), done      # History: every epoch once
    assert done["size"] == 1, done


def test_only_the_lost_processes_roll_back_and_the_leave_redoes_no_step(run):
    _, out, _, _ = run
    attempts = _done(out)["attempts"]
    tried = [a[0] for a in attempts]
    # epoch 1 (lost server) and 3 (lost scheduler) again from their commit;
    # the joining server is taken at epoch 2's commit (a second attempt
    # that trains nothing before it); the leave at epoch 5's, without a rollback
    assert [e for e in range(EPOCHS) if tried.count(e) > 1] == [1, 2, 3] or \
        [e for e in range(EPOCHS) if tried.count(e) > 1] == [1, 3], attempts
    finished = {}
    for epoch, batches, size in attempts:
        if batches == STEPS:
            assert epoch not in finished, attempts      # no epoch is trained twice in full
            finished[epoch] = size
    assert finished == {0: 2, 1: 2, 2: 2, 3: 2, 4: 2, 5: 1}, attempts
    # the epoch of the SIGTERM ran once, all its steps: 0 steps redone
    assert [a for a in attempts if a[0] == 4] == [[4, STEPS, 2]], attempts


def test_epochs_equal_an_uninterrupted_run_bit_for_bit(run):
    proc, out, ref, ref_out = run
    assert proc.returncode == 0 and ref is not None and ref.returncode == 0, \
        _tail(ref or proc)
    for k in range(1, EPOCHS):
        got = _load(os.path.join(out, f"e_commit_e{k}.npz"))
        want = _load(os.path.join(ref_out, f"r_commit_e{k}.npz"))
        assert _identical(got, want), (k, [float(np.abs(a - b).max()) for a, b in zip(got, want)])
    # the last epoch, trained by one worker: one process on the global batch
    got = _load(os.path.join(out, "e_final_r0.npz"))
    want = _load(os.path.join(ref_out, f"one_from_e{EPOCHS - 1}.npz"))
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, want)) <= 1e-6


def test_every_epoch_equals_one_process_on_the_global_batch(run):
    _, out, ref, ref_out = run
    assert ref is not None and ref.returncode == 0, _tail(ref)
    for k in range(1, EPOCHS):
        got = _load(os.path.join(out, f"e_commit_e{k}.npz"))
        want = _load(os.path.join(ref_out, f"one_e{k}.npz"))
        worst = max(float(np.abs(a - b).max()) for a, b in zip(got, want))
        assert worst <= 1e-5, (k, worst)


def test_recovery_times(run):
    _, out, _, _ = run
    recovery = _done(out)["recovery"]
    assert set(recovery) == {"server", "scheduler"}, recovery
    print("seconds from the SIGKILL to training again:", recovery)
    assert recovery["server"] < 30 * TIMEOUT_SCALE and recovery["scheduler"] < 60 * TIMEOUT_SCALE
