"""model.fit under BytePSStrategy(elastic=True) in every shape (issue 44,
items 6-9 and 14; docs/elastic.md): one elastic job of
tests/workers/elastic_shapes.py -- evaluate before fit, a loop of
fit(epochs=1), predict between, a fit with Keras' stateful callbacks, then
evaluate and predict -- in which a worker fails during evaluate, another
during predict, two replacements start the script from the top and join the
last fit (1 -> 3 workers sharing a global batch of 20 unevenly), and the
checkpoint writer is SIGKILLed mid-epoch. Everything every survivor saw must
equal one process running the same script on the global batch (run beside
the job), epoch by epoch. And the quick-start example with a worker count
that does not divide its batch (3 workers, 64)."""
import glob
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_runner import ROOT, TIMEOUT_SCALE, launch  # noqa: E402
from saved_arrays import load as _load  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "workers", "elastic_shapes.py")
# Float sums in another order (2 or 3 workers against one process), through
# a few dozen Adam steps: measured 1.2e-7 at most.
ATOL = 1e-6
RTOL = 1e-5   # losses and metrics (up to 8 here) sum the batches in another order too


def _tail(proc):
    return f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"


def _close(a, b):
    return len(a) == len(b) and all(np.allclose(x, y, rtol=0, atol=ATOL) for x, y in zip(a, b))


def _diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("elastic_shapes"))
    hosts = os.path.join(out, "hosts")
    with open(hosts, "w") as f:
        # Hosts are hosts (as under horovodrun): a failed worker blacklists
        # its host, and a replacement starts when the script offers a new
        # one (elastic_shapes.py adds two when its plan wants newcomers).
        f.write("".join(f"127.0.0.{i}:1\n" for i in range(1, 4)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", BYTEPS_TIMEOUT="4")
    env.pop("TF_CONFIG", None)
    timeout = int(200 * TIMEOUT_SCALE)
    reference = subprocess.Popen([sys.executable, SCRIPT, out], env=dict(env, REF="1"),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 cwd=tempfile.gettempdir())
    cmd = [sys.executable, "-m", "bps_tf.launch", "-np", "3", "--servers", "1",
           "--min-np", "1", "--max-np", "3", "--host-discovery-script", f"cat {hosts}",
           "--discovery-interval", "0.5",
           "--timeout", str(timeout - 15), sys.executable, SCRIPT, out]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=tempfile.gettempdir())
        ref_out, ref_err = reference.communicate(timeout=timeout)
    finally:
        reference.kill()
    with open(os.path.join(out, "launch.log"), "w") as f:   # the whole story, when one fails
        f.write(proc.stdout + proc.stderr)
    return proc, out, (reference.returncode, ref_out, ref_err)


def _seen(out, rank):
    with open(os.path.join(out, f"seen_{rank}.json")) as f:
        return json.load(f)


def test_the_job_survives_a_failure_in_evaluate_and_in_predict_and_a_kill_in_fit(job):
    proc, out, ref = job
    assert ref[0] == 0, ref[2][-6000:]
    log = proc.stdout + proc.stderr
    assert "planned failure of worker 2 during evaluate" in log, _tail(proc)
    assert "planned failure of worker 1 during predict" in log, _tail(proc)
    assert "was killed by signal SIGKILL" in log, _tail(proc)
    assert log.count("elastic evaluate: the workers changed") >= 2, _tail(proc)   # 2 survivors
    assert "elastic predict: the workers changed" in log, _tail(proc)
    survivors = [_seen(out, r) for r in ("r0", "r1")]
    assert [s["newcomer"] for s in survivors] == [True, True], survivors   # W0 was killed
    assert all(s["size"] == 2 for s in survivors)


def test_the_job_exits_0(job):
    """Apart from the results: a job whose workers finished exits 0 (a
    worker that lingers at its exit fails this one alone)."""
    proc, _, _ = job
    assert proc.returncode == 0, _tail(proc)


@pytest.mark.parametrize("rank", ["r0", "r1"])
def test_every_call_a_survivor_saw_equals_one_process(job, rank):
    """Both survivors joined during the last fit: evaluate, both fits and
    predict before it are replays of what the job returned; the rest they ran."""
    _, out, _ = job
    got, want = _seen(out, rank), _seen(out, "ref")
    for name in ("evaluate0", "evaluate5", "predict3", "predict6"):
        assert np.allclose(got[name], want[name], rtol=RTOL, atol=ATOL), (name, got[name],
                                                                         want[name])
    for name in ("fit1", "fit2", "fit4"):
        assert got[name]["epoch"] == want[name]["epoch"], (name, got[name], want[name])
        assert np.allclose(got[name]["loss"], want[name]["loss"], rtol=RTOL, atol=ATOL), name


@pytest.mark.parametrize("rank", ["r0", "r1"])
def test_callback_state_survives_the_changes(job, rank):
    """EarlyStopping stops where one process stops (patience not started
    again), ReduceLROnPlateau reduced as often, BackupAndRestore(save_freq=3)
    trained no extra epoch, the checkpoint written by the newcomer that
    became rank 0 still holds the best epoch's weights, and a user's
    callbacks (elastic_state_attributes, get/set_elastic_state) count every
    batch and epoch once."""
    _, out, _ = job
    got, want = _seen(out, rank), _seen(out, "ref")
    assert want["fit4"]["epoch"] == list(range(6)) and want["fit4"]["stopped_epoch"] == 5
    assert got["fit4"]["epoch"] == want["fit4"]["epoch"], got["fit4"]
    assert got["fit4"]["stopped_epoch"] == want["fit4"]["stopped_epoch"], got["fit4"]
    assert abs(got["fit4"]["learning_rate"] - want["fit4"]["learning_rate"]) < 1e-9, got["fit4"]
    # A user's callbacks: the batches and epochs of the call, once each.
    assert want["fit4"]["batches"] == 6 * 12 and want["fit4"]["epochs_seen"] == list(range(6))
    assert got["fit4"]["batches"] == want["fit4"]["batches"], got["fit4"]
    assert got["fit4"]["epochs_seen"] == want["fit4"]["epochs_seen"], got["fit4"]
    assert _close(_load(os.path.join(out, f"checkpoint_{rank}.npz")),
                  _load(os.path.join(out, "checkpoint_ref.npz")))
    assert _close(_load(os.path.join(out, f"final_{rank}.npz")),
                  _load(os.path.join(out, "final_ref.npz")))
    assert not os.path.exists(os.path.join(out, "backup")), "rank 0 deletes the backup at the end"


def test_each_epoch_equals_one_process_on_the_global_batch(job):
    """Rank 0's weights when each epoch began (after the elastic commit; the
    last attempt of each) against one process's, with 1, 2 and 3 workers
    (3 share the batch of 20 as 7, 7 and 6)."""
    _, out, _ = job
    last, sizes = {}, {}
    for path in glob.glob(os.path.join(out, "start_c*_e*_n*_t*.npz")):
        call, epoch, size, stamp = os.path.basename(path)[len("start_"):-4].split("_")
        key = (call, epoch)
        sizes.setdefault(key, set()).add(int(size[1:]))
        if key not in last or float(stamp[1:]) > last[key][0]:
            last[key] = (float(stamp[1:]), path)
    want_keys = {tuple(os.path.basename(p)[len("start_"):-4].split("_")[:2])
                 for p in glob.glob(os.path.join(out, "start_c*_e*_ref.npz"))}
    assert set(last) == want_keys, (sorted(last), sorted(want_keys))
    assert {3} <= sizes[("c4", "e3")] and 2 in sizes[("c4", "e5")], sizes
    worst = {}
    for (call, epoch), (_, path) in sorted(last.items()):
        ref = _load(os.path.join(out, f"start_{call}_{epoch}_ref.npz"))
        worst[(call, epoch)] = _diff(_load(path), ref)
    assert max(worst.values()) < ATOL, worst


def test_one_process_with_three_devices_shares_an_uneven_batch_exactly(job):
    local = _seen(job[1], "ref")["local_replicas"]
    assert local["replicas"] == 3
    assert max(local["diffs"]) < 1e-6, local


def test_quick_start_with_a_worker_count_that_does_not_divide_the_batch():
    """bpslaunch -np 3 python examples/keras_digits.py: a global batch of 64
    is split 22, 22, 20 (it failed at the first step)."""
    proc = launch(3, 1, [os.path.join(ROOT, "examples", "keras_digits.py"), "--epochs", "2"],
                  timeout=150)
    assert proc.returncode == 0, _tail(proc)
    line = [x.split("test accuracy:", 1)[1] for x in (proc.stdout + proc.stderr).splitlines()
            if "test accuracy:" in x]
    assert len(line) == 1 and "(3 workers, 3 replicas)" in line[0], _tail(proc)
    assert float(line[0].split(",")[0]) > 0.7, line
