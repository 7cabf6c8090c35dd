"""Horovod's join and Min/Max/Product on the servers across 2 real workers:
one bpslaunch cluster runs tests/workers/join_checks.py (the same join
checks also run at 3 workers in test_tf_multiworker.py's cluster)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_runner import ROOT, passed_details, run_checks  # noqa: E402

pytest.importorskip("tensorflow")

WORKERS, SERVERS = 2, 2
CHECKS = os.path.join(ROOT, "tests", "workers", "join_checks.py")
PARITY_DTYPES = ("uint8", "int8", "uint16", "int16", "int32", "int64",
                 "float16", "bfloat16", "float32", "float64")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("join_checks"))
    env = {"BYTEPS_PARTITION_BYTES": "65536",
           "BYTEPS_OP_TIMEOUT": "30"}          # a lost contribution fails instead of hanging
    found, log, _ = run_checks(WORKERS, SERVERS, CHECKS, out, env=env, timeout=300)
    return found, log


def _check(ranks, name):
    found, log = ranks
    assert all(data["size"] == WORKERS for data in found.values())
    return list(passed_details(found, log, name).values())


def test_join_uneven_steps_exact_twice_and_returns_the_last_rank(ranks):
    # The second epoch's last rank is 0 on every rank (the first's is checked inside).
    assert _check(ranks, "join_uneven_steps") == ["0"] * WORKERS


def test_join_refuses_broadcast_from_a_joined_root_and_allgather(ranks):
    assert _check(ranks, "join_refuses_broadcast_allgather") == ["root", "refused refused"]


def test_join_with_distributed_gradient_tape_and_uneven_batches(ranks):
    for detail in _check(ranks, "join_tape_training"):
        assert float(detail.split()[-1]) <= 1e-5


def test_join_with_distributed_optimizer_fit_and_uneven_batches(ranks):
    for detail in _check(ranks, "join_fit_distributed_optimizer"):
        assert float(detail.split()[-1]) <= 1e-5


def test_min_max_product_every_dtype_on_two_workers(ranks):
    for detail in _check(ranks, "parity_allreduce"):
        assert detail.split() == list(PARITY_DTYPES)
    _check(ranks, "parity_server_reductions")


def test_all_checks_finished(ranks):
    _check(ranks, "finished")
