"""Cross-step overlap under an unchanged model.fit (BytePSStrategy(overlap=True),
bps_tf/overlap/fit.py) across real processes: one bpslaunch cluster (2 workers,
2 servers) runs tests/workers/overlap_fit_checks.py, which trains every case
with overlap off and on and compares them bit for bit; the tests read what each
worker recorded. About 1-2 minutes."""
import json
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_runner import ROOT, passed_details, run_checks  # noqa: E402

pytest.importorskip("tensorflow")

WORKERS, SERVERS = 2, 2
CHECKS = os.path.join(ROOT, "tests", "workers", "overlap_fit_checks.py")
# One optimizer per kind of update the deferred apply must keep exact: plain,
# a slot (momentum, with BatchNormalization), two slots and the step count,
# weight decay with a schedule, moving statistics, a global norm, sparse rows,
# factored slots. Keras' other
# per-variable optimizers (Adagrad, Adadelta, Adamax, Ftrl, Lion) take the
# same path; tests/test_api_single.py checks that the overlap accepts them.
EXACT = ["sgd", "adam", "adamw_schedule_spe3", "momentum_bn", "global_clipnorm",
         "embedding_adam", "graph_probe", "rmsprop_bn_spe2", "adafactor"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("overlap_fit_checks"))
    env = {"BYTEPS_OP_TIMEOUT": "60"}   # a lost tensor fails instead of hanging
    found, log, code = run_checks(WORKERS, SERVERS, CHECKS, out, env=env, timeout=600)
    return found, log, code


def _check(ranks, name):
    found, log, _ = ranks
    return passed_details(found, log, name)


@pytest.mark.parametrize("case", EXACT)
def test_fit_with_overlap_is_bit_identical_to_the_barrier(ranks, case):
    # In the worker: weights (BatchNormalization's moving statistics too),
    # optimizer variables, iterations, history, weights read by a callback
    # after batch 2 are equal bit for bit, and nothing is pending; in the
    # cases of FLUSH_CHECKED (tests/workers/overlap_fit_checks.py) also the
    # validation loss, a mid-epoch ModelCheckpoint file, evaluate() and
    # predict() after fit.
    for detail in _check(ranks, case).values():
        assert detail["overlapped"], detail


def test_sparse_gradients_keep_the_barrier_with_one_log_line(ranks):
    for detail in _check(ranks, "embedding_adam").values():
        sparse = [line for line in detail["log"] if "sparse gradients" in line]
        assert len(sparse) == 1 and "embedding" in sparse[0], detail["log"]


def test_ema_falls_back_to_the_barrier_with_one_log_line(ranks):
    for detail in _check(ranks, "ema_fallback").values():
        assert not detail["overlapped"]
        assert len(detail["log"]) == 1 and "EMA" in detail["log"][0], detail["log"]


@pytest.mark.parametrize("case,reason", [("train_step_fallback", "overrides train_step"),
                                         ("tied_fallback", "is shared by layers")])
def test_models_overlap_cannot_see_into_fall_back_with_one_log_line(ranks, case, reason):
    # A custom train_step or tied weights may read a variable before its
    # deferred update: trained with the barrier, equal to overlap=False.
    for detail in _check(ranks, case).values():
        assert not detail["overlapped"]
        assert len(detail["log"]) == 1 and reason in detail["log"][0], detail["log"]


def test_a_read_before_the_deferred_update_retraces_with_the_barrier(ranks):
    # A layer reads a later layer's kernel (not its own attribute, so no
    # heuristic sees it): the traced step is checked op by op, the read is
    # found, and fit retraces the step with the barrier before it runs.
    for detail in _check(ranks, "reads_later_fallback").values():
        assert not detail["overlapped"], detail
        lines = [line for line in detail["log"] if "outside the layers' own forward" in line]
        assert len(lines) == 1 and "dense" in lines[0] and "kernel" in lines[0], detail["log"]


def test_reads_from_another_thread_during_fit_see_a_barrier_weight(ranks):
    # Each read waits for the running step and flushes (StepLock): it sees
    # a kernel the barrier run had after some step, and the weights after
    # fit stay bit-identical.
    for detail in _check(ranks, "thread_reads").values():
        assert detail["reads"] > 10 and detail["distinct"] >= 2, detail


def test_reads_between_train_on_batch_calls_see_the_barriers_weights(ranks):
    # After each train_on_batch, a kernel's numpy() and a tf.function of the
    # caller's on the model equal the barrier's bit for bit.
    for detail in _check(ranks, "train_on_batch").values():
        assert detail["reads"] == 8


def test_start_priorities_follow_the_forward_passs_first_reads(ranks):
    # Created third, second, first (so listed in that order), called first,
    # second, third: the first layer's kernel then bias leave first.
    for detail in _check(ranks, "priorities").values():
        assert [v.split("/")[-1] for v in detail["variables"]] == ["kernel", "bias"] * 3
        # listed third (kernel, bias), second, first: ranks in call order
        assert detail["priorities"] == [-4, -5, -2, -3, 0, -1], detail


WRITES = ["set_weights", "assign", "load_weights", "lookahead", "early_stopping_restore",
          "swap_ema", "checkpoint_restore"]


@pytest.mark.parametrize("case", WRITES)
def test_weights_written_between_steps_land_after_the_pending_update(ranks, case):
    # A callback (or a restore between fits) writes the weights while step
    # k's update is pending: overlap applies it first, so the final weights
    # equal the barrier's bit for bit (tests/workers/overlap_write_checks.py).
    for rank, detail in _check(ranks, "writes").items():
        assert detail[case]["same"], (rank, case, detail[case])


def test_nadam_falls_back_to_the_barrier_with_one_log_line(ranks):
    # Nadam advances one shared product per step, so no update of it can be
    # deferred alone: trained with the barrier, equal to overlap=False.
    for detail in _check(ranks, "nadam_fallback").values():
        assert not detail["overlapped"]
        assert len(detail["log"]) == 1 and "Nadam" in detail["log"][0], detail["log"]


def test_next_steps_first_layer_ran_before_the_last_push_pull_was_delivered(ranks):
    # Rank 0 held back the last variable's sum of step 3 (kept from its wait
    # once finished); an identity marker after the first Dense layer ends the
    # hold. Under a barrier, step 4 could not start before that sum was
    # delivered, and the hold could only end by its 10 s timeout.
    last_key = _check(ranks, "sgd")[0]["keys"][-1]
    log = _check(ranks, "hold_log")[0]["log"].splitlines()
    assert len(log) == 1, log
    assert log[0] in (f"{last_key} released-by marker", f"{last_key} in-flight-at marker"), log


def test_a_new_optimizer_from_compile_turns_overlap_off_with_one_log_line(ranks):
    for detail in _check(ranks, "recompile").values():
        lines = [line for line in detail["log"] if "after compile()" in line]
        assert len(lines) == 1, detail["log"]


def test_bad_overlap_arguments_and_disagreeing_workers_are_refused(ranks):
    for detail in _check(ranks, "arguments").values():
        assert "overlap='yes'" in detail["not_bool"]
        assert "fp16" in detail["fp16"] and "choose one" in detail["fp16"]
        assert "1 of 2 workers" in detail["disagree"], detail["disagree"]


def test_the_job_ends_cleanly(ranks):
    assert ranks[2] == 0, ranks[1]


def test_a_server_killed_while_push_pulls_are_pending_fails_fit_with_its_name(tmp_path):
    # Fast failure detection: a dead peer is declared after 3 s of silence.
    from manual_cluster import ManualCluster
    env = {"BYTEPS_TIMEOUT": "3", "BYTEPS_HEARTBEAT_INTERVAL": "0.5",
           "BYTEPS_FATAL_EXIT_GRACE": "5", "TF_CPP_MIN_LOG_LEVEL": "2"}
    worker = os.path.join(ROOT, "tests", "workers", "overlap_fit_kill.py")
    with ManualCluster(2, 2, [worker, str(tmp_path)], env=env) as c:
        deadline = time.time() + 240
        while not all(os.path.exists(tmp_path / f"ready{r}") for r in range(2)):
            assert time.time() < deadline, c.log("worker0")[-3000:]
            assert all(p.poll() is None for p in c.workers), c.log("worker0")[-3000:]
            time.sleep(0.1)
        pending = json.loads((tmp_path / "ready0").read_text())
        assert pending, "nothing was pending when the server was killed"
        os.killpg(c.servers[1].pid, 9)
        c.servers[1].wait()
        (tmp_path / "killed").write_text("")
        assert c.wait_all(c.workers, timeout=60), "a worker hung after the server died"
        for r, p in enumerate(c.workers):
            assert p.returncode != 0, c.log(f"worker{r}")[-3000:]
        error = json.loads((tmp_path / "error0.json").read_text())
        assert "server 1" in error["message"], error
