"""The TensorFlow API across real processes: one bpslaunch cluster (3 workers,
2 servers) runs tests/workers/tf_checks.py; the tests below read what each
worker recorded. One launch keeps the cost to about 30 s (each TensorFlow
process takes seconds to start)."""
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_runner import ROOT, passed_details, run_checks  # noqa: E402

pytest.importorskip("tensorflow")

WORKERS, SERVERS = 3, 2
# Small partitions keep "3 partitions + 1 element" cheap; 1 MiB spans 16 of them.
PARTITION_BYTES = 65536
CHECKS = os.path.join(ROOT, "tests", "workers", "tf_checks.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tf_checks"))
    env = {"BYTEPS_PARTITION_BYTES": str(PARTITION_BYTES),
           "BYTEPS_OP_TIMEOUT": "30"}          # a lost tensor fails instead of hanging
    found, log, code = run_checks(WORKERS, SERVERS, CHECKS, out, env=env, timeout=420)
    return found, log


def _check(ranks, name):
    """The details each rank recorded for check `name`, after asserting it passed."""
    found, log = ranks
    assert all(data["size"] == WORKERS for data in found.values())
    return list(passed_details(found, log, name).values())


def test_all_checks_finished(ranks):
    _check(ranks, "finished")


def test_partition_size_reached_the_workers(ranks):
    assert _check(ranks, "partition_bytes") == [str(PARTITION_BYTES)] * WORKERS


def test_workers_keep_freed_message_buffers_in_the_heap(ranks):
    # BYTEPS_MALLOC_KEEP_BUFFERS defaults to on, and glibc took the settings.
    assert _check(ranks, "heap_keeps_buffers") == ["True"] * WORKERS


def test_push_pull_every_dtype_and_size(ranks):
    details = _check(ranks, "push_pull_dtypes")
    # Every dtype ran every size, including one element past 3 partitions.
    for dtype in ("float16", "bfloat16", "float32", "float64", "int32", "int64"):
        item = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
                "int32": 4, "int64": 8}[dtype]
        for label, n in (("0", 0), ("1", 1), ("7", 7), ("1MiB", (1 << 20) // item),
                         ("3parts+1", 3 * PARTITION_BYTES // item + 1)):
            assert f"{dtype}:{label}={n}" in details[0].split()


def test_fifty_push_pulls_in_flight_in_one_function(ranks):
    _check(ranks, "fifty_in_flight")


def test_fp16_compression_and_unnamed_eager_calls(ranks):
    _check(ranks, "fp16_and_unnamed")


def test_strategy_fp16_compression_scales_and_refuses_the_optimizers(ranks):
    _check(ranks, "strategy_fp16")


def test_broadcast_from_rank_1(ranks):
    _check(ranks, "broadcast_from_rank1")


def test_broadcast_variables_from_rank_1(ranks):
    _check(ranks, "broadcast_variables_from_rank1")


def test_allgather_with_different_row_counts(ranks):
    _check(ranks, "allgather")


def test_gradient_tape_training_equals_single_process(ranks):
    for detail in _check(ranks, "tape_training"):
        assert float(detail.split()[-1]) <= 1e-5


def test_fit_with_distributed_optimizer_keeps_workers_identical(ranks):
    for detail in _check(ranks, "fit_distributed_optimizer"):
        assert float(detail.split()[-1]) <= 1e-5


def test_mixed_precision_overflow_on_one_worker_skips_the_step_everywhere(ranks):
    # Every rank: 4 batches, one skipped (rank 0's overflow), the scale halved once.
    details = _check(ranks, "mixed_precision")
    assert len(details) == 3 and all(d.startswith("iterations 3 scale ") for d in details)


def test_shape_mismatch_error_names_tensor_and_both_shapes(ranks):
    for message in _check(ranks, "shape_mismatch"):
        assert "mismatch/w" in message, message
        shapes = set(re.findall(r"float32\[(\d+)\]", message))
        assert len(shapes) >= 2 and shapes <= {"2", "3", "4"}, message


def test_broadcast_root_mismatch_error_names_tensor_and_both_roots(ranks):
    for message in _check(ranks, "root_mismatch"):
        assert "mismatch/root" in message and "differs across workers" in message, message
        assert "root=0" in message and "root=1" in message, message


# Horovod parity (tests/workers/parity_checks.py), in the same cluster
PARITY_DTYPES = ("uint8", "int8", "uint16", "int16", "int32", "int64",
                 "float16", "bfloat16", "float32", "float64")


def test_parity_allreduce_every_dtype_sum_average_min_max_product_wrapping(ranks):
    for detail in _check(ranks, "parity_allreduce"):
        assert detail.split() == list(PARITY_DTYPES)


def test_parity_min_max_product_on_servers_function_gradients_and_op_mismatch(ranks):
    _check(ranks, "parity_server_reductions")


# Horovod's join (tests/workers/join_checks.py), in the same cluster
def test_join_uneven_steps_exact_twice_and_returns_the_last_rank(ranks):
    assert _check(ranks, "join_uneven_steps") == ["0"] * WORKERS


def test_join_refuses_broadcast_from_a_joined_root_and_allgather(ranks):
    assert _check(ranks, "join_refuses_broadcast_allgather") == \
        ["root"] + ["refused refused"] * (WORKERS - 1)


def test_join_with_distributed_gradient_tape_and_uneven_batches(ranks):
    for detail in _check(ranks, "join_tape_training"):
        assert float(detail.split()[-1]) <= 1e-5


def test_join_with_distributed_optimizer_fit_and_uneven_batches(ranks):
    for detail in _check(ranks, "join_fit_distributed_optimizer"):
        assert float(detail.split()[-1]) <= 1e-5


def test_parity_allgather_and_broadcast_every_dtype_and_bool(ranks):
    _check(ranks, "parity_allgather_broadcast")


def test_parity_reducescatter_uneven_first_dimension(ranks):
    details = _check(ranks, "parity_reducescatter")
    # 7 rows over 3 ranks: 3, 2, 2; 2 rows: 1, 1, 0
    for rank, detail in enumerate(details):
        items = detail.split()
        assert len(items) == 2 * len(PARITY_DTYPES)
        assert f"int8:7->{[3, 2, 2][rank]}" in items and f"int8:2->{[1, 1, 0][rank]}" in items


def test_parity_alltoall_uneven_one_sided_and_empty_splits(ranks):
    _check(ranks, "parity_alltoall")


def test_parity_barrier_waits_for_the_last_worker(ranks):
    _check(ranks, "parity_barrier")


def test_parity_broadcast_in_place(ranks):
    _check(ranks, "parity_broadcast_in_place")


def test_parity_allgather_object_uneven_sizes(ranks):
    _check(ranks, "parity_allgather_object")


def test_parity_gradient_predivide_factor_equals_the_average(ranks):
    _check(ranks, "parity_gradient_predivide_factor")


def test_parity_local_sources_elastic_state_and_integer_prescale(ranks):
    _check(ranks, "parity_horovod_peer_semantics")


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_parity_gradients_of_every_collective_match_the_definition(ranks, mode):
    for detail in _check(ranks, f"parity_gradients_{mode}"):
        assert set(detail) == {"allreduce_sum", "allreduce_average", "broadcast_root1",
                               "allgather", "reducescatter_sum", "alltoall"}, detail


def test_parity_sync_batch_norm_equals_batch_norm_on_the_whole_batch(ranks):
    for detail in _check(ranks, "parity_sync_batch_norm"):
        assert float(detail.split()[-1]) <= 1e-5
