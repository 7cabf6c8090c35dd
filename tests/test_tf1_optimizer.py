"""TF1 sessions on 2 workers: bps_tf.DistributedOptimizer wrapping a
tf.compat.v1.train optimizer (an MLP with an embedding lookup: a sparse
gradient), and a plain optimizer with bps_tf.compat.v1.enable_graph_rewrite().
Weights end equal on both workers and within 1e-6 of one process trained on
the concatenated batches. SGD, Momentum and Adam; resource and ref variables.
Under the rewrite the embedding's sparse gradient is gathered exactly; a
sparse update it cannot trace to tf.gradients' output is refused, naming it.
One cluster runs tests/workers/tf1_checks.py once."""
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_runner import ROOT, launch  # noqa: E402

CHECKS = os.path.join(ROOT, "tests", "workers", "tf1_checks.py")
CASES = [f"{m}_{o}_{v}" for m in ("wrap", "rewrite") for o in ("adam", "sgd", "momentum")
         for v in ("resource", "ref")]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tf1")
    proc = launch(2, 1, [CHECKS, str(out)], timeout=300)
    return proc, out


@pytest.mark.parametrize("case", CASES)
def test_workers_agree_and_match_one_process(run, case):
    proc, out = run
    assert proc.returncode == 0, proc.stderr[-6000:]
    for rank in range(2):
        error = out / f"{case}.rank{rank}.error"
        assert not error.exists(), error.read_text()
    results = [np.load(out / f"{case}.rank{rank}.npz") for rank in range(2)]
    names = [k[4:] for k in results[0].files if k.startswith("got_")]
    assert sorted(names) == ["table", "w1", "w2"]
    for name in names:
        np.testing.assert_array_equal(results[0][f"got_{name}"], results[1][f"got_{name}"])
        np.testing.assert_allclose(results[0][f"got_{name}"], results[0][f"ref_{name}"],
                                   rtol=0, atol=1e-6, err_msg=name)


def _json_of_each_rank(run, what):
    """What each rank wrote to <what>.rank<r>.txt (JSON, or an error)."""
    proc, out = run
    assert proc.returncode == 0, proc.stderr[-6000:]
    found = []
    for rank in range(2):
        text = (out / f"{what}.rank{rank}.txt").read_text()
        assert not text.startswith("error"), text
        found.append(json.loads(text))
    return found


def test_gradients_of_every_collective_in_a_session_match_the_definition(run):
    for got in _json_of_each_rank(run, "gradients"):
        assert set(got) == {"allreduce_sum", "allreduce_average", "broadcast_root1",
                            "allgather", "reducescatter_sum", "alltoall"}, got


def test_the_graph_rewrite_refuses_an_untraceable_sparse_update_naming_it(run):
    proc, out = run
    assert proc.returncode == 0, proc.stderr[-6000:]
    for rank in range(2):
        message = (out / f"sparse_refused.rank{rank}.txt").read_text()
        assert "sparse gradient" in message and "ResourceScatterAdd" in message, message
        assert "cannot be traced" in message
        assert "bps_tf.DistributedOptimizer" in message


def test_global_variables_come_from_the_root_through_the_hook_and_the_op(run):
    # Rank r starts w at r + 1 and v at 10 (r + 1); the hook broadcasts from
    # rank 1 when the MonitoredTrainingSession is created, the op from rank 0.
    for got in _json_of_each_rank(run, "broadcast_globals"):
        assert got == {"hook_w": [2.0, 2.0, 2.0], "hook_step": 0, "op_v": [10.0]}, got


def _expected_aggregation(passes, average, runs, size=2):
    """w and table[1] after each run: gradients (r + 1) * (run + 1) (twice
    that for the row) on rank r, summed over the passes (divided by the
    passes if averaged), averaged over the ranks, applied with rate 1 on every
    passes-th run; global_step counts every run."""
    w, out, pending = 0.0, [], 0.0
    for run in range(runs):
        pending += sum((r + 1) * (run + 1) for r in range(size)) / size
        if (run + 1) % passes == 0:
            w -= pending / (passes if average else 1)
            pending = 0.0
        out.append([w, 2 * w, run + 1])
    return out


def test_a_tf1_optimizer_sums_backward_passes_and_predivides_as_horovod(run):
    # Horovod's TF1 DistributedOptimizer: backward_passes_per_step sums the
    # passes locally (averaged with average_aggregated_gradients), exchanges
    # once and applies on every N-th run; global_step still counts each run.
    for got in _json_of_each_rank(run, "aggregation"):
        assert got["passes3_sum"] == _expected_aggregation(3, False, 7), got
        assert got["passes3_average_dense_rows"] == _expected_aggregation(3, True, 7), got
        # factor 2: halves before the sum, divides by size / 2 after: an average
        assert got["predivide2"] == _expected_aggregation(1, False, 2), got
