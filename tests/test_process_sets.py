"""Horovod process sets across real processes: one bpslaunch cluster (3
workers, 2 servers) runs tests/workers/process_set_checks.py, whose sets
[0, 1], [1, 2] and [2] leave a rank out of each; the tests read what each
worker recorded (results checked against numpy inside the workers)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_runner import ROOT, passed_details, run_checks  # noqa: E402

pytest.importorskip("tensorflow")

WORKERS, SERVERS = 3, 2
CHECKS = os.path.join(ROOT, "tests", "workers", "process_set_checks.py")
# An error must reach every rank within seconds, not after a stall timeout.
ERROR_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("process_set_checks"))
    env = {"BYTEPS_OP_TIMEOUT": "60", "BYTEPS_STALL_CHECK_TIME_SECONDS": "30"}
    found, log, _ = run_checks(WORKERS, SERVERS, CHECKS, out, env=env, timeout=300)
    return found, log


def _check(ranks, name):
    found, log = ranks
    return passed_details(found, log, name)


def test_all_checks_finished(ranks):
    _check(ranks, "finished")


def test_registered_sets_have_ids_sizes_and_set_ranks(ranks):
    # id:size:rank-in-set for [0, 1], [1, 2], [2]; -1 outside a set
    assert _check(ranks, "registry") == {0: "1:2:0 2:2:-1 3:1:-1",
                                         1: "1:2:1 2:2:0 3:1:-1",
                                         2: "1:2:-1 2:2:1 3:1:0"}


def test_eager_collectives_within_sets_interleaved_with_global_ones(ranks):
    assert _check(ranks, "eager") == {0: "A", 1: "A B", 2: "B D"}


def test_disjoint_sets_use_one_name_at_once(ranks):
    assert _check(ranks, "disjoint_same_name") == {0: "2", 1: "2", 2: "1"}


def test_tf_function_and_gradients_within_a_set(ranks):
    assert set(_check(ranks, "tf_function").values()) == {"ok"}


def test_min_max_product_on_the_servers_within_sets(ranks):
    assert set(_check(ranks, "reduce_ops").values()) == {"ok"}


def test_keras_distributed_optimizer_within_a_set(ranks):
    assert _check(ranks, "keras_optimizer") == {0: "ok", 1: "ok", 2: "outside"}


def test_removed_ids_are_reused_and_sets_print_as_in_horovod(ranks):
    assert set(_check(ranks, "id_reuse").values()) == {"ok"}


def test_tf1_session_within_a_set(ranks):
    assert _check(ranks, "tf1_session") == {0: "outside", 1: "ok", 2: "ok"}


@pytest.mark.parametrize("name", ["op_mismatch", "min_max_mismatch", "set_mismatch"])
def test_mismatches_fail_on_every_rank_within_seconds(ranks, name):
    for rank, detail in _check(ranks, name).items():
        seconds = float(detail.split()[0])
        assert seconds < ERROR_WITHIN_S, (rank, detail)
        assert "differs across workers" in detail, (rank, detail)


def test_add_process_set_with_different_ranks_fails_on_every_rank(ranks):
    for rank, detail in _check(ranks, "add_mismatch").items():
        assert "add_process_set" in detail and "differs across workers" in detail, detail


# --------------------------------------------------------------------------
# The core alone (numpy workers): servers, scheduler and stall check
# --------------------------------------------------------------------------
CORE_CHECKS = os.path.join(ROOT, "tests", "workers", "process_set_core.py")


@pytest.fixture(scope="module")
def core_ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("process_set_core"))
    env = {"BYTEPS_PARTITION_BYTES": "4096", "BYTEPS_STALL_CHECK_TIME_SECONDS": "2",
           "BYTEPS_LOG_LEVEL": "WARNING"}
    found, log, code = run_checks(WORKERS, SERVERS, CORE_CHECKS, out, env=env, timeout=120)
    return found, log, code


def test_core_overlapping_sets_and_global_sums_are_exact_over_many_rounds(core_ranks):
    found, log, _ = core_ranks
    assert set(passed_details(found, log, "exact_sums").values()) == {"20"}


def test_core_refuses_a_rank_outside_the_set_and_malformed_sets(core_ranks):
    found, log, _ = core_ranks
    passed_details(found, log, "refusals")


def test_core_join_within_sets_counts_only_joined_members(core_ranks):
    found, log, _ = core_ranks
    # Rank 0 joined last, and every rank hears it.
    assert set(passed_details(found, log, "join_in_sets").values()) == {"0"}


def test_core_stall_check_names_only_the_missing_member(core_ranks):
    found, log, code = core_ranks
    passed_details(found, log, "finished")
    assert code == 0, log
    # Rank 2 is outside the set [0, 1]: only rank 0 is missing.
    assert "tensor 'core/stalled' submitted by worker(s) 1 but not by worker(s) 0 (" in log, log
