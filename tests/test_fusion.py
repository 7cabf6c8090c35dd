"""Tensor fusion and the TF op's output buffers across real processes: one
bpslaunch cluster (2 workers, 2 servers) runs tests/workers/fusion_checks.py
and the tests below read what each worker recorded."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_runner import ROOT, passed_details, run_checks  # noqa: E402
from bps_tf.runtime import config  # noqa: E402

WORKERS, SERVERS = 2, 2
CHECKS = os.path.join(ROOT, "tests", "workers", "fusion_checks.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("tensorflow")
    out = str(tmp_path_factory.mktemp("fusion_checks"))
    # 64 KiB messages: the mixed tensors need several fused messages per
    # server and step; 256 KB partitions cut the large tensor in five.
    env = {"BYTEPS_FUSION_THRESHOLD": "65536", "BYTEPS_PARTITION_BYTES": "256000",
           "BYTEPS_OP_TIMEOUT": "60"}  # a lost partition fails instead of hanging
    found, log, code = run_checks(WORKERS, SERVERS, CHECKS, out, env=env, timeout=300)
    return found, log


def _check(ranks, name):
    return list(passed_details(*ranks, name).values())


def test_fused_messages_give_exact_sums_of_mixed_sizes_dtypes_and_priorities(ranks):
    for detail in _check(ranks, "mixed"):
        assert detail.startswith("fused sent")


def test_a_held_result_is_never_overwritten_by_the_next_step(ranks):
    _check(ranks, "held")


def test_a_result_returned_twice_stays_intact(ranks):
    _check(ranks, "twice")


def test_results_kept_in_a_list_stay_intact(ranks):
    _check(ranks, "list")


def test_a_free_output_buffer_is_reused_and_a_held_one_is_not(ranks):
    _check(ranks, "reused")


def test_every_check_finished(ranks):
    _check(ranks, "finished")


def test_fusion_settings_read_horovods_names_when_bytepss_are_unset():
    assert config.value("BYTEPS_FUSION_THRESHOLD", {}) == 262144
    assert config.value("BYTEPS_FUSION_THRESHOLD", {"HOROVOD_FUSION_THRESHOLD": "1024"}) == 1024
    both = {"HOROVOD_FUSION_THRESHOLD": "1024", "BYTEPS_FUSION_THRESHOLD": "0"}
    assert config.value("BYTEPS_FUSION_THRESHOLD", both) == 0
    assert config.value("BYTEPS_FUSION_CYCLE_TIME_MS", {"HOROVOD_CYCLE_TIME": "2.5"}) == 2.5
    assert config.core_settings({"HOROVOD_CYCLE_TIME": "1"})["fusion_cycle_ms"] == 1.0


@pytest.mark.parametrize("env, text", [("HOROVOD_FUSION_THRESHOLD", "-1"),
                                       ("BYTEPS_FUSION_THRESHOLD", "lots"),
                                       ("HOROVOD_CYCLE_TIME", "-3")])
def test_bad_fusion_settings_are_named(env, text):
    with pytest.raises(ValueError, match=env):
        config.core_settings({env: text})
