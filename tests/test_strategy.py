"""BytePSStrategy with Keras 3: multi-worker fit, priorities, BackupAndRestore.

Three kinds of runs, each paid for once:

* one 2-worker x 2-logical-device cluster (2 servers) running
  tests/workers/strategy_checks.py: SGD, Adam, Dropout and unsynchronized
  BatchNormalization scenarios (Embedding, validation data,
  steps_per_execution=2), compared across workers and with a single-process
  reference; replica-context variable updates; model.predict gathering;
* one single process (tests/workers/strategy_single.py): gradient priorities
  in a traced Keras train step, XLA turned off;
* two 2-worker launches of tests/workers/strategy_backup.py: a crash in the
  second epoch, then a relaunch that resumes from the backup;
* examples/keras_digits.py as a 3-task TF_CONFIG job (ps, chief, worker).
"""
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
WORKERS = REPO / "tests" / "workers"
LAUNCH_TIMEOUT_S = 3000   # bounds a hang; a loaded machine runs the cluster 2-3x slower
NEUTRAL_DIR = tempfile.gettempdir()  # `python -m` must not see the source tree


def _env():
    # The caller's PYTHONPATH passes through; the repository is not added,
    # because in a fresh clone it has no native libraries and would shadow
    # the installed package.
    env = dict(os.environ)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    # Replicas compared every 4 steps: every fit here checks its weights.
    env["BYTEPS_FINGERPRINT_STEPS"] = "4"
    for name in ("TF_CONFIG", "DMLC_ROLE"):   # a stray cluster must not leak in
        env.pop(name, None)
    return env


def _launch(script, args, workers=2, servers=2):
    cmd = [sys.executable, "-m", "bps_tf.launch", "-np", str(workers), "--servers", str(servers),
           sys.executable, str(WORKERS / script), *map(str, args)]
    return subprocess.run(cmd, cwd=NEUTRAL_DIR, env=_env(), capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)


def _tail(proc):
    return f"rc={proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"


# --------------------------------------------------------------------------
# The multi-worker run
# --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    out = tmp_path_factory.mktemp("strategy_checks")
    proc = _launch("strategy_checks.py", [out])
    reports = []
    for rank in range(2):
        path = out / f"rank{rank}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else None)
    return proc, out, reports


def _scenario(cluster, name):
    proc, out, reports = cluster
    assert all(reports), _tail(proc)
    entries = [r["scenarios"].get(name, {}) for r in reports]
    for rank, entry in enumerate(entries):
        assert entry.get("ok"), f"rank {rank}: {entry.get('error')}\n{_tail(proc)}"
    arrays = [np.load(out / f"{name}.rank{rank}.npz") for rank in range(2)]
    return entries, arrays


def _weights(arrays, prefix="w"):
    return [arrays[k] for k in sorted((k for k in arrays.files if k.startswith(prefix)
                                       and k[len(prefix):].isdigit()),
                                      key=lambda k: int(k[len(prefix):]))]


def test_cluster_runs_every_scenario(cluster):
    proc, _, reports = cluster
    assert proc.returncode == 0, _tail(proc)
    for rank, report in enumerate(reports):
        assert report is not None and report.get("done"), _tail(proc)
        assert report["rank"] == rank and report["size"] == 2
        # 2 workers x 2 local devices: Keras scales the loss by this
        assert report["replicas"] == 4
        assert report["should_checkpoint"] == (rank == 0)
        # TensorFlow's tutorial idiom: strategy.cluster_resolver.task_type / task_id
        assert report["resolver"] == ["worker", rank]


def test_reductions_go_across_workers(cluster):
    proc, _, reports = cluster
    for rank, report in enumerate(reports):
        p = report["primitives"]
        assert "error" not in p, p.get("error")
        assert p["host_sum"] == 1 + 2                       # one value per worker
        assert p["replica_ids"] == [2.0 * rank, 2.0 * rank + 1]   # global replica ids
        assert p["nested_mean"] == [1.5, 1.5]               # mean of ids 0..3
        assert p["gather"] == [0.0, 1.0, 2.0, 3.0]
        assert p["int32_sum"] == 4                          # int32 is not left local


def _expected_uneven_sums(counts, replicas_per_worker=2):
    # Step s: replica j of worker w takes element 2s+j of range(counts[w]),
    # if there is one; the data ends when no worker has an element left.
    steps = max(-(-n // replicas_per_worker) for n in counts)
    return [sum(e for n in counts
                for e in range(s * replicas_per_worker, (s + 1) * replicas_per_worker) if e < n)
            for s in range(steps)]


def test_uneven_datasets_run_until_every_worker_is_out_of_data(cluster):
    """The per-step end-of-data sum (bps_tf.strategy.data_check): a worker whose own
    data ran out feeds empty batches until the other's ends, traced and eager."""
    proc, _, reports = cluster
    expected = _expected_uneven_sums((3, 8))
    assert expected == [(0 + 1) * 2, 2 + (2 + 3), 4 + 5, 6 + 7]   # worker 0 out after step 1
    for rank, report in enumerate(reports):
        data = report["uneven_data"]
        assert "error" not in data, data.get("error")
        assert data["traced"] == expected, (rank, data["traced"])
        assert data["eager"] == expected, (rank, data["eager"])


def test_workers_with_different_local_device_counts_are_refused(cluster):
    _, _, reports = cluster
    for report in reports:
        vote = report["device_count_vote"]
        assert "different numbers of local replicas" in vote, vote
        assert "rank 0: 2, rank 1: 1" in vote, vote


def test_workers_in_different_keras_phases_fail_at_once_in_keras_terms(cluster):
    # fit(epochs=1 + rank); then rank 0 evaluates while rank 1 fits; then a
    # callback stops rank 1 after epoch 1. Each fails on every worker at that
    # boundary, naming what each worker was doing, well within 10 s of the
    # later worker reaching it, and the job goes on.
    _, _, reports = cluster
    assert all(reports), reports
    # Both workers' clocks are this machine's CLOCK_MONOTONIC.
    last_at = {k: max(r["phases"][k]["boundary_at"] for r in reports)
               for k in ("epochs", "evaluate", "stop")}
    for report in reports:
        phases = report["phases"]
        assert set(phases) == {"epochs", "evaluate", "stop"}, phases
        epochs, evaluate, stop = (phases[k]["error"] for k in ("epochs", "evaluate", "stop"))
        assert epochs and "worker 1 started fit with epochs=2" in epochs, epochs
        assert "worker 0 started fit with epochs=1" in epochs, epochs
        assert evaluate and "worker 0 started evaluate" in evaluate, evaluate
        assert "worker 1 started fit with epochs=1" in evaluate, evaluate
        assert stop and "worker 1 ended epoch 1 of fit and stops training" in stop, stop
        assert "worker 0 ended epoch 1 of fit and goes on to epoch 2" in stop, stop
        delays = {k: phases[k]["raised_at"] - last_at[k] for k in phases}
        assert all(0 <= d < 10 for d in delays.values()), (delays, phases)


def test_variables_built_in_another_order_are_refused_naming_both(cluster):
    _, _, reports = cluster
    for report in reports:
        error = report["drift"]["build_order"]
        assert error and "differs across workers" in error, error
        assert "var=encoder/kernel" in error and "var=decoder/kernel" in error, error


@pytest.mark.parametrize("case", ["fit_perturbed", "tape_skipped", "optimizer_skipped"])
def test_replicas_that_drifted_apart_are_caught_within_the_check_interval(cluster, case):
    # One worker's weight is changed between steps (fit), or one worker skips
    # one step's exchange and applies its own gradient (a custom loop with
    # DistributedGradientTape, with DistributedOptimizer): every worker fails
    # at the next fingerprint check (every 4 steps here), naming a variable.
    _, _, reports = cluster
    for report in reports:
        error = report["drift"][case]
        assert error and "drifted apart" in error and "rank 0" in error and "rank 1" in error, \
            error
        assert "kernel" in error, error


def test_the_fit_fingerprint_counts_across_fits_and_checks_at_each_end(cluster):
    # Two fits of 3 batches each (interval 4), rank 1's weight changed in the
    # second: caught at that fit's end (its 6th batch), not never.
    _, _, reports = cluster
    for report in reports:
        error = report["drift"]["short_fits"]
        assert error and "drifted apart" in error and "at its end (batch 6" in error, error


def test_per_replica_statistics_of_sync_state_false_are_no_drift(cluster):
    # BytePSStrategy(sync_state=False): each replica's own BatchNormalization
    # statistics differ by design and are left out; a weight is still checked.
    _, _, reports = cluster
    for report in reports:
        assert report["drift"]["sync_state_off"] is None, report["drift"]["sync_state_off"]
        error = report["drift"]["sync_state_off_perturbed"]
        assert error and "drifted apart" in error and "kernel" in error, error
        assert "moving_mean" not in error and "moving_variance" not in error, error


def test_workers_must_agree_on_the_early_data_check(cluster):
    _, _, reports = cluster
    for report in reports:
        assert ("1 of 2 workers have BYTEPS_EARLY_DATA_CHECK=1 (ranks [0]) and the others 0"
                in report["early_check_vote"]), report["early_check_vote"]


def test_a_get_next_made_by_one_worker_only_is_reported(tmp_path):
    """Nothing waits for the end-of-data sum of a worker that has a batch, so
    an extra next() on rank 0 alone no longer fails in its step: the unmatched
    sum is reported when rank 0 exits. BYTEPS_TIMEOUT bounds how long the
    server waits for rank 0, which leaves after seeing rank 1 gone."""
    env = dict(_env(), BYTEPS_TIMEOUT="5")
    cmd = [sys.executable, "-m", "bps_tf.launch", "-np", "2", "--servers", "1",
           sys.executable, str(WORKERS / "data_check_extra_call.py")]
    proc = subprocess.run(cmd, cwd=NEUTRAL_DIR, env=env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert "rank 0: steps done" in out and "rank 1: steps done" in out, _tail(proc)
    reported = [line for line in out.splitlines() if "was not matched by every worker" in line]
    assert len(reported) == 1 and reported[0].startswith("[worker 0]"), _tail(proc)
    assert "bps.strategy/data_check/" in reported[0], reported


def test_a_worker_with_a_batch_does_not_wait_for_the_end_of_data_sum(cluster):
    """The end-of-data sum of a traced step was held from its wait until a
    marker that follows the step's result: the marker ran (no timeout), so
    the step did not need the sum."""
    proc, _, reports = cluster
    for rank, report in enumerate(reports):
        data = report["uneven_data"]
        assert "error" not in data, data.get("error")
        assert len(data["pending_keys"]) == 1, data["pending_keys"]
        key = data["pending_keys"][0]
        assert key.startswith("bps.strategy/data_check/"), key
        lines = data["hold_log"].splitlines()
        assert len(lines) == 1 and lines[0].startswith(key + " "), lines
        assert lines[0].split()[-1] == "marker", lines   # not "timeout"


def test_fit_on_each_workers_own_dataset_covers_every_row_and_ends_together(cluster):
    """AutoShardPolicy.OFF datasets of 24 and 40 rows, then 40 and 40, after
    a fit on an infinite dataset: 4 rows per worker and step, so every epoch
    takes 10 steps on both workers (before: Keras counted 3 or 5 batches of
    8, the longer worker waited for sums the other never sent, and with
    equal lengths each epoch trained on half the rows)."""
    _, _, reports = cluster
    for report in reports:
        data = report["own_datasets"]
        assert "error" not in data, data.get("error")
        assert data["uneven"] == [10, 10] and data["even"] == [10, 10], data
    assert reports[0]["own_datasets"]["weights"] == reports[1]["own_datasets"]["weights"]


def test_mixed_precision_fit_trains_and_skips_an_overflow_on_every_worker(cluster):
    """Under mixed_float16, Keras' LossScaleOptimizer checks each replica's
    own gradients before the sum: the check is agreed (bps_tf.strategy.loss_scale), so
    an overflow on one replica of rank 0 skips the step on all four replicas,
    and every worker halves its scale."""
    _, _, reports = cluster
    for poisoned in (False, True):
        runs = [report[f"mixed_precision_{poisoned}"] for report in reports]
        for run in runs:
            assert "error" not in run, run.get("error")
            assert run["optimizer"] == "LossScaleOptimizer"
            assert run["finite"] and run["replica_spread"] == 0.0, run
            # 32 rows per worker, 4 per worker and step (OFF: a batch of 8 is global)
            assert run["iterations"] == (7 if poisoned else 8), run
            assert run["scale"] == run["initial_scale"] / (2 if poisoned else 1), run
        assert runs[0]["weights"] == runs[1]["weights"]
    clean, skipped = (reports[0][f"mixed_precision_{p}"]["weights"] for p in (False, True))
    assert clean != skipped   # the skipped step really is one fewer update


@pytest.mark.parametrize("name", ["sgd", "adam", "dropout", "bn"])
def test_workers_end_with_identical_weights(cluster, name):
    entries, arrays = _scenario(cluster, name)
    init0, init1 = _weights(arrays[0], "init_w"), _weights(arrays[1], "init_w")
    final0, final1 = _weights(arrays[0]), _weights(arrays[1])
    assert len(final0) == len(final1) > 0
    for a, b in zip(init0, init1):    # rank 0's initial values reached rank 1
        np.testing.assert_array_equal(a, b)
    for a, b in zip(final0, final1):
        np.testing.assert_array_equal(a, b)
    # training happened
    assert max(float(np.abs(a - b).max()) for a, b in zip(final0, init0)) > 1e-3
    assert entries[0]["history"] == entries[1]["history"]


def test_replica_context_assignments_reach_every_worker(cluster):
    """A variable assigned in strategy.run ends with the same value on every
    replica of every worker, per its aggregation (4 replicas, ids 0..3)."""
    _, _, reports = cluster
    for report in reports:
        assigned = report["primitives"]["assigned"]
        assert assigned["mean"] == [1.5, 1.5]          # mean of the replica ids
        assert assigned["sum"] == [4.0, 4.0]           # 1 from each replica
        assert assigned["first"] == [10.0, 10.0]       # rank 0's first replica
        # non-trainable float without an aggregation: averaged (as MEAN)
        assert assigned["state"] == [1.5, 1.5]


def _bn_data():
    # tests/workers/strategy_checks.py make_data(): the training features
    rng = np.random.RandomState(1234)
    return rng.randn(96 + 44, 8).astype("float32")[:96].astype("float64")


def test_all_weights_identical_with_unsynchronized_batch_norm(cluster):
    """Adam + Embedding + two BatchNormalization(synchronized=False): every
    weight, moving statistics included, is bitwise the same on both workers
    (test_workers_end_with_identical_weights[bn]) and on both local replicas,
    and the moving statistics did move."""
    entries, arrays = _scenario(cluster, "bn")
    for entry in entries:
        assert entry["replica_spread"] == 0.0
    for rank in range(2):
        assert np.abs(arrays[rank]["inbn_mean"]).max() > 1e-3       # moved from 0
        np.testing.assert_array_equal(arrays[rank]["inbn_mean"], arrays[0]["inbn_mean"])
        np.testing.assert_array_equal(arrays[rank]["inbn_var"], arrays[0]["inbn_var"])


def test_moving_statistics_follow_the_global_batches(cluster):
    """What equality holds, and why. Each of the 4 replicas (2 workers x 2
    devices) normalizes its quarter of the global batch of 16 and computes
    m_r = 0.99*m + 0.01*mean_r; the update written is their MEAN over all
    replicas (TensorFlow's aggregation MEAN), i.e. 0.99*m + 0.01*mean(mean_r).

    * moving mean: the mean of equal-size quarters' means is the global
      batch mean, so it equals one process trained on the global batches
      (the reference run);
    * moving variance: the mean of the quarters' variances is not the
      global batch variance (it lacks the spread between the quarters'
      means), so it equals that average computed here with numpy, and not
      the one-process value.
    The input BatchNormalization sees the raw features (no trained layer
    before it), which makes both computable from the data alone."""
    _, out, _ = cluster
    _, arrays = _scenario(cluster, "bn")
    reference = np.load(out / "bn.reference.npz")
    feats = _bn_data()
    mean, var_quarters, var_global = np.zeros(8), np.ones(8), np.ones(8)
    for _ in range(3):                                   # epochs
        for k in range(6):                               # global batches of 16
            batch = feats[16 * k:16 * (k + 1)]
            quarters = batch.reshape(4, 4, 8)
            mean = 0.99 * mean + 0.01 * quarters.mean(axis=1).mean(axis=0)
            var_quarters = 0.99 * var_quarters + 0.01 * quarters.var(axis=1).mean(axis=0)
            var_global = 0.99 * var_global + 0.01 * batch.var(axis=0)
    got_mean, got_var = arrays[0]["inbn_mean"], arrays[0]["inbn_var"]
    np.testing.assert_allclose(got_mean, reference["inbn_mean"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(got_mean, mean, rtol=0, atol=1e-6)
    np.testing.assert_allclose(reference["inbn_var"], var_global, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got_var, var_quarters, rtol=0, atol=1e-5)
    assert np.abs(got_var - var_global).max() > 1e-3


def test_model_predict_returns_every_row_in_order(cluster):
    """model.predict(x) with 10 rows on 2 workers (5 each, batch_size=4: a
    full and a partial batch) returns the 10 rows on every worker, equal to
    a plain model.predict on one process with the same weights."""
    _, out, _ = cluster
    _, arrays = _scenario(cluster, "sgd")
    plain = np.load(out / "sgd.plain_predict.rank0.npy")
    assert plain.shape == (10, 3)
    for rank in range(2):
        np.testing.assert_array_equal(arrays[rank]["predict10"], arrays[0]["predict10"])
        np.testing.assert_allclose(arrays[rank]["predict10"], plain, rtol=0, atol=1e-6)
        # one row, two workers: rank 0 predicts none, rank 1 the row
        np.testing.assert_allclose(arrays[rank]["predict1"], plain[:1], rtol=0, atol=1e-6)


def test_predict_shard_option_keeps_the_per_worker_shard(cluster):
    """BytePSStrategy(predict="shard"): Keras' own behaviour, each worker's
    shard of every batch (10 rows, batches of 4 split 2+2, 2+2, 1+1)."""
    _, arrays = _scenario(cluster, "dropout")
    assert [arrays[r]["predict10"].shape[0] for r in range(2)] == [5, 5]


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_fit_matches_one_process_on_the_global_batches(cluster, name):
    _, out, _ = cluster
    _, arrays = _scenario(cluster, name)
    ref_report = json.loads((out / f"{name}.reference.json").read_text())
    assert "error" not in ref_report, ref_report["error"]
    reference = np.load(out / f"{name}.reference.npz")
    for i, (got, want) in enumerate(zip(_weights(arrays[0]), _weights(reference))):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=f"weight {i}")
    assert len(_weights(arrays[0])) == len(_weights(reference))


def test_byteps_mirrored_strategy_trains_on_every_workers_own_batches(cluster):
    """bps_tf.distribute.MirroredStrategy, BytePS's name: each worker feeds
    its own half of every global batch; the step averages over both halves,
    so the weights match one process on the whole batches."""
    proc, out, reports = cluster
    entries, arrays = _scenario(cluster, "bps_mirrored")
    assert [e["replicas"] for e in entries] == [4, 4]
    # unsharded input, predict="shard": each worker predicts all of its rows
    assert [e["predict_rows"] for e in entries] == [10, 10]
    reference = np.load(out / "sgd.reference.npz")
    for rank in range(2):
        got = _weights(arrays[rank])
        assert len(got) == len(_weights(reference))
        for i, (g, want) in enumerate(zip(got, _weights(reference))):
            np.testing.assert_allclose(g, want, rtol=0, atol=1e-5, err_msg=f"rank {rank} w{i}")


def test_byteps_mirrored_strategy_refuses_other_cross_device_ops():
    import bps_tf.distribute
    with pytest.raises(ValueError, match="push_pull"):
        bps_tf.distribute.MirroredStrategy(cross_device_ops=object())
    with pytest.raises(ValueError, match="own predictions"):
        bps_tf.distribute.MirroredStrategy(predict="all")


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_metrics_and_evaluate_are_global(cluster, name):
    _, out, _ = cluster
    entries, _ = _scenario(cluster, name)
    reference = json.loads((out / f"{name}.reference.json").read_text())
    assert entries[0]["evaluate"] == entries[1]["evaluate"]
    # global: the same as one process evaluating the whole validation set
    np.testing.assert_allclose(entries[0]["evaluate"], reference["evaluate"], atol=1e-4)
    for key in ("loss", "val_loss", "val_accuracy"):
        np.testing.assert_allclose(entries[0]["history"][key], reference["history"][key],
                                   atol=1e-4, err_msg=key)


def test_gather_predictions_returns_every_row_in_order(cluster):
    _, out, _ = cluster
    _, arrays = _scenario(cluster, "sgd")
    reference = np.load(out / "sgd.reference.npz")
    np.testing.assert_array_equal(arrays[0]["preds"], arrays[1]["preds"])
    assert arrays[0]["preds"].shape == reference["preds"].shape == (44, 3)
    np.testing.assert_allclose(arrays[0]["preds"], reference["preds"], atol=1e-4)


def test_model_checkpoint_writes_on_rank0_only(cluster):
    _, out, _ = cluster
    entries, _ = _scenario(cluster, "sgd")
    target = str(out / "ckpt.weights.h5")
    assert entries[0]["saves"] == [target] * 3             # one save per epoch
    assert len(entries[1]["saves"]) == 3                   # rank 1 saved too ...
    for path in entries[1]["saves"]:                       # ... into a private temp dir
        assert path != target and not os.path.exists(path)
    assert os.path.exists(target)


def test_push_pull_names_and_priorities_agree_across_workers(cluster):
    entries, _ = _scenario(cluster, "adam")
    ranks = [sorted(map(tuple, e["priorities"])) for e in entries]
    assert ranks[0] == ranks[1] and ranks[0]
    names = [tensor_name for _, tensor_name, _ in ranks[0]]
    assert len(names) == len(set(names))                   # one push_pull per name
    per_variable = {}
    for variable, _, priority in ranks[0]:
        per_variable.setdefault(variable, set()).add(priority)
    # 7 trainable variables; each worker sends one push_pull per dense
    # gradient (its 2 replicas are summed first), and 4 for the sparse one
    # (row counts and rows, of values and of indices).
    assert len(per_variable) == 7
    counts = sorted(sum(1 for v, _, _ in ranks[0] if v == name) for name in per_variable)
    assert counts == [1, 1, 1, 1, 1, 1, 4]
    assert sorted(p for ps in per_variable.values() for p in ps) == list(range(-6, 1))
    # The embedding is read first in the forward pass: highest priority.
    top = max(ranks[0], key=lambda r: r[2])
    assert "embedding" in top[0] and top[2] == 0


# --------------------------------------------------------------------------
# Single process: priorities from the traced train step
# --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def single():
    proc = subprocess.run([sys.executable, str(WORKERS / "strategy_single.py")], cwd=NEUTRAL_DIR,
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, _tail(proc)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_priorities_follow_the_forward_pass(single):
    priorities = single["priorities"]
    # one push_pull per dense gradient (the embedding's is sparse, and sparse
    # gradients need no push_pull in a one-worker job)
    got = {k.split("/", 1)[1]: v for k, v in priorities.items()}
    assert all(len(v) == 1 for v in got.values())
    expected = [name for name in single["forward_order"] if name in got]
    assert len(expected) == 6
    by_priority = sorted(got, key=lambda k: -got[k][0])
    assert by_priority == expected
    assert [got[k][0] for k in expected] == [0, -1, -2, -3, -4, -5]
    # ... which is not the order the layers were declared in
    declared = [p.split("/", 1)[1] for p in single["declared_order"] if p.split("/", 1)[1] in got]
    assert declared != expected


def test_priority_scheduling_can_be_turned_off():
    env = dict(_env(), BYTEPS_PRIORITY_SCHEDULING="0")
    proc = subprocess.run([sys.executable, str(WORKERS / "strategy_single.py")], cwd=NEUTRAL_DIR,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, _tail(proc)
    priorities = json.loads(proc.stdout.strip().splitlines()[-1])["priorities"]
    values = {v for pr in priorities.values() for v in pr}
    assert len(priorities) == 6 and len(values) == 1, priorities  # FIFO: one priority


def test_single_process_strategy(single):
    assert single["replicas"] == 2 and single["should_checkpoint"] and single["trained"]
    assert single["jit_compile"] is False      # compiled with jit_compile=True
    assert single["bad_predict"] == ("BytePSStrategy(predict='gather'): expected one of "
                                     "'all', 'shard'.")


# --------------------------------------------------------------------------
# BackupAndRestore across a crash
# --------------------------------------------------------------------------
def test_backup_and_restore_resumes_after_a_crash(tmp_path):
    out, backup = tmp_path / "out", tmp_path / "backup"
    out.mkdir()
    crash = _launch("strategy_backup.py", [out, backup, "crash"], servers=1)
    assert crash.returncode != 0, _tail(crash)
    crashed = [json.loads((out / f"crash.rank{r}.json").read_text()) for r in range(2)]
    assert crashed[1].get("crashed_at") == [1, 2], _tail(crash)
    assert not crashed[0].get("done") and crashed[0]["epochs"] == [0, 1]
    assert (backup / "latest.weights.h5").exists()
    saved = crashed[0]["after_first_epoch"]

    resume = _launch("strategy_backup.py", [out, backup, "resume"], servers=1)
    assert resume.returncode == 0, _tail(resume)
    resumed = [json.loads((out / f"resume.rank{r}.json").read_text()) for r in range(2)]
    for report in resumed:
        assert report.get("done")
        assert report["epochs"] == [1, 2, 3]               # starts at the second epoch
        np.testing.assert_allclose(report["after_restore"], saved, rtol=1e-6)
    assert resumed[0]["final"] == resumed[1]["final"]
    assert resumed[0]["final"] != saved
    assert not backup.exists()                             # deleted at the end by rank 0

    # The resumed job ends where an uninterrupted run of the same seed ends.
    straight = _launch("strategy_backup.py", [out, tmp_path / "backup2", "straight"], servers=1)
    assert straight.returncode == 0, _tail(straight)
    reference = json.loads((out / "straight.rank0.json").read_text())
    assert reference["epochs"] == [0, 1, 2, 3]
    np.testing.assert_allclose(resumed[0]["final"], reference["final"], rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------
# TF_CONFIG (as a Kubeflow TFJob writes it) and the example
# --------------------------------------------------------------------------
def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_example_trains_under_tf_config(tmp_path):
    """Every task runs the same command with only TF_CONFIG set, as in a
    TFJob: the ps task serves (inside BytePSStrategy()), chief and worker
    train; the chief prints the test accuracy."""
    cluster = {"chief": [f"127.0.0.1:{_free_port()}"], "worker": [f"127.0.0.1:{_free_port()}"],
               "ps": [f"127.0.0.1:{_free_port()}"]}
    tasks = [("ps", 0), ("chief", 0), ("worker", 0)]
    procs = []
    try:
        for kind, index in tasks:
            env = _env()
            env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": kind, "index": index},
                                           "environment": "cloud"})
            log = open(tmp_path / f"{kind}{index}.log", "w+")
            procs.append((kind, log, subprocess.Popen(
                [sys.executable, str(REPO / "examples" / "keras_digits.py"), "--epochs", "10"],
                cwd=NEUTRAL_DIR, env=env, stdout=log, stderr=subprocess.STDOUT)))
        deadline = time.time() + LAUNCH_TIMEOUT_S
        for kind, log, proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        for _, _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outputs = {}
    for kind, log, proc in procs:
        log.seek(0)
        outputs[kind] = log.read()
        log.close()
    for kind, _, proc in procs:
        assert proc.returncode == 0, f"{kind} exited {proc.returncode}:\n{outputs[kind][-4000:]}"
    match = re.search(r"test accuracy: ([0-9.]+).*\(2 workers, 2 replicas\)", outputs["chief"])
    assert match, outputs["chief"][-4000:]
    assert float(match.group(1)) >= 0.9
    assert "test accuracy" not in outputs["worker"]     # only rank 0 prints
