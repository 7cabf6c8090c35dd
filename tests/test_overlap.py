"""Cross-step overlap (bps_tf.overlap, the split push_pull ops) across real
processes: one bpslaunch cluster (2 workers, 2 servers, free ports chosen by
bpslaunch) runs tests/workers/overlap_checks.py; the tests read what each
worker recorded. About 10-40 s."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_runner import ROOT, passed_details, run_checks  # noqa: E402

pytest.importorskip("tensorflow")

WORKERS, SERVERS = 2, 2
CHECKS = os.path.join(ROOT, "tests", "workers", "overlap_checks.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("overlap_checks"))
    env = {"BYTEPS_OP_TIMEOUT": "60",   # a lost tensor fails instead of hanging
           "BYTEPS_TRACE_ON": "1", "BYTEPS_TRACE_DIR": os.path.join(out, "trace"),
           "BYTEPS_TRACE_START_STEP": "1", "BYTEPS_TRACE_END_STEP": "2"}
    found, log, code = run_checks(WORKERS, SERVERS, CHECKS, out, env=env, timeout=300)
    return found, log, code, out


def _check(ranks, name):
    found, log = ranks[0], ranks[1]
    return passed_details(found, log, name)


def test_a_pending_key_cannot_be_started_twice_and_wait_takes_it_once(ranks):
    _check(ranks, "start_twice")


@pytest.mark.parametrize("name", ["exact_sgd", "exact_momentum", "exact_adam",
                                  "exact_adam_2_steps_per_call",
                                  "exact_adamw_schedule_clipnorm",
                                  "exact_rmsprop_centered"])
def test_overlapped_weights_are_bit_identical_and_flush_is_idempotent(ranks, name):
    # Inside the worker: weights, optimizer slots and iterations after 6 steps
    # + flush equal the DistributedGradientTape + optimizer.apply loop bit for
    # bit; flush leaves nothing pending; a second flush applies nothing.
    for detail in _check(ranks, name).values():
        assert detail["steps"] >= 5 and detail["vars"] == 6


def test_every_variable_is_pending_between_steps(ranks):
    for detail in _check(ranks, "exact_sgd").values():
        assert sorted(detail["pending_before_flush"]) == sorted(detail["keys"])


def test_next_steps_first_layer_ran_before_the_last_push_pull_was_delivered(ranks):
    # Rank 0 held back the last variable's sum of step 3 (kept from its wait
    # once finished); an identity marker after layer 1 ends the hold. If step
    # 4's layer 1 needed that sum (a barrier) the hold could only time out.
    _check(ranks, "exact_sgd")
    log = _check(ranks, "hold_log")[0]["log"].splitlines()
    last_key = _check(ranks, "exact_sgd")[0]["keys"][-1]
    assert len(log) == 1, log
    assert log[0] in (f"{last_key} released-by marker", f"{last_key} in-flight-at marker"), log


def test_reads_between_steps_see_the_barriers_weights(ranks):
    # numpy() of a kernel and a tf.function summing the weights directly,
    # after each step: equal bit for bit to the barrier loop's after the
    # same step (the pending updates are applied first).
    for detail in _check(ranks, "reads_between_steps").values():
        assert detail["reads"] >= 4, detail


def test_an_engine_failure_is_raised_by_the_wait(ranks):
    for detail in _check(ranks, "engine_failure").values():
        assert detail["error"] == "FailedPreconditionError"
        assert "Overlap/test/mismatch" in detail["message"]


def test_the_timeline_shows_each_wait_after_its_push_pull(ranks):
    # Every overlapped variable of the first check has, in steps 1 and 2, a
    # push_pull slice and a wait slice (the layer asking for the sum in the
    # next step) on its row; a sum is handed over only once its push_pull
    # has finished, so the wait ends no earlier than the push_pull.
    keys = _check(ranks, "exact_sgd")[0]["keys"]
    for rank in range(WORKERS):
        with open(os.path.join(ranks[3], "trace", f"bps_trace_rank{rank}.json")) as f:
            events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
        ops = {(e["args"]["tensor_name"], e["args"]["step"]): e
               for e in events if e["cat"] == "push_pull"}
        waits = {(e["args"]["tensor_name"], e["args"]["step"]): e
                 for e in events if e["cat"] == "overlap"}
        assert all(w["name"] == "wait" for w in waits.values())
        for key in keys:
            for step in (1, 2):
                op, wait = ops[(key, step)], waits[(key, step)]
                assert op["tid"] == wait["tid"]
                assert op["ts"] + op["dur"] <= wait["ts"] + wait["dur"], (key, step, op, wait)


def test_the_job_ends_cleanly(ranks):
    assert ranks[2] == 0, ranks[1]
