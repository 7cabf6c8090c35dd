"""The core's compressors across real processes: one bpslaunch cluster (2
workers, 2 servers) runs tests/workers/compression_checks.py -- push_pull of
each compressor with exact expectations, error feedback step by step, the
tape, the Keras DistributedOptimizer and model.fit under BytePSStrategy --
and the tests below read what each worker recorded."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_runner import ROOT, passed_details, run_checks  # noqa: E402

pytest.importorskip("tensorflow")

WORKERS, SERVERS = 2, 2
CHECKS = os.path.join(ROOT, "tests", "workers", "compression_checks.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("compression_checks"))
    env = {"BYTEPS_PARTITION_BYTES": "4096", "BYTEPS_MIN_COMPRESS_BYTES": "4096",
           "BYTEPS_OP_TIMEOUT": "60"}          # a lost tensor fails instead of hanging
    found, log, code = run_checks(WORKERS, SERVERS, CHECKS, out, env=env, timeout=300)
    return found, log


def _check(ranks, name):
    return list(passed_details(*ranks, name).values())


def test_all_checks_finished(ranks):
    _check(ranks, "finished")


def test_onebit_sum_is_the_servers_recompression_of_the_workers_signs(ranks):
    details = _check(ranks, "onebit")
    assert details[0] == details[1]


@pytest.mark.parametrize("name", ["topk", "randomk", "dithering"])
def test_sparse_and_dithered_sums_are_exact(ranks, name):
    _check(ranks, name)


def test_error_feedback_on_workers_and_servers_matches_the_core_step_by_step(ranks):
    for detail in _check(ranks, "error_feedback"):
        assert "relative error" in detail


def test_small_and_float64_tensors_travel_uncompressed(ranks):
    _check(ranks, "uncompressed")


def test_topk_sends_a_fraction_of_the_bytes(ranks):
    for detail in _check(ranks, "wire_bytes"):
        sent, raw = int(detail.split()[0]), int(detail.split()[-1])
        assert sent < 0.03 * raw


def test_workers_that_disagree_on_the_compressor_are_refused_with_both_named(ranks):
    for detail in _check(ranks, "disagree"):
        assert "topk ratio=0.01" in detail and "topk ratio=0.02" in detail


def test_distributed_gradient_tape_with_onebit(ranks):
    _check(ranks, "tape")


def test_keras_distributed_optimizer_with_dithering_keeps_workers_identical(ranks):
    first, second = _check(ranks, "keras_optimizer")
    assert first["weights"] == second["weights"]
    assert first["loss"][-1] < first["loss"][0]


def test_fit_under_bytepsstrategy_with_topk_keeps_workers_identical(ranks):
    first, second = _check(ranks, "strategy_fit")
    assert first["weights"] == second["weights"]
    sent, raw = first["bytes"]
    assert sent < 0.6 * raw


def test_strategy_compression_touches_gradients_only(ranks):
    # Under BytePSStrategy(compression=topk(0.01, error_feedback=True)), a
    # user's all_reduce of 4,096 floats inside strategy.run and a
    # strategy.reduce are exact sums, and a 32-class MeanIoU and
    # SyncBatchNormalization's output equal the uncompressed strategy's.
    for detail in _check(ranks, "gradients_only"):
        plain, compressed = detail["mean_iou"]
        assert abs(plain - compressed) < 1e-6 and 0 < plain < 1, detail


def test_resuming_a_stateful_compressor_warns_once(ranks):
    # docs/compression.md#resuming-from-a-checkpoint: error-feedback state is
    # not in the checkpoint; BackupAndRestore says so when it resumes.
    for detail in _check(ranks, "resume_warning"):
        assert "topk" in detail and "not bit-identical" in detail, detail
