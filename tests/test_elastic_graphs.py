"""Graphs that outlive a membership (docs/elastic.md): a Horovod script's
@tf.function step, traced once with 2 workers, runs unchanged after a third
worker joins, and every collective in it answers for the membership it runs
in -- the average divides by 3, the allgather has 3 rows, size_op and
rank_op read the new values -- without being traced again."""
import glob
import json
import os
import subprocess
import sys
import tempfile

import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers",
                      "elastic_graph_reuse.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("graphs"))
    hosts = os.path.join(out, "hosts")
    with open(hosts, "w") as f:
        f.write("localhost:2\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", BYTEPS_TIMEOUT="6")
    env.pop("TF_CONFIG", None)
    cmd = [sys.executable, "-m", "bps_tf.launch", "-np", "2", "--servers", "1",
           "--min-np", "2", "--max-np", "3", "--host-discovery-script", f"cat {hosts}",
           "--discovery-interval", "0.3", "--timeout", "280", sys.executable, WORKER, out,
           hosts]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                          cwd=tempfile.gettempdir())
    steps = {}
    for path in glob.glob(os.path.join(out, "step*_r*.json")):
        with open(path) as f:
            data = json.load(f)
        steps[os.path.basename(path)[:-5]] = data
    return proc, steps


def _tail(proc):
    return f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def test_the_job_finishes(run):
    proc, steps = run
    assert proc.returncode == 0, _tail(proc)
    assert sorted(steps) == ["step0_r0", "step0_r1", "step1_r0", "step1_r1", "step1_r2",
                             "step2_r0", "step2_r1", "step2_r2"], (sorted(steps), _tail(proc))


@pytest.mark.parametrize("name", ["step0_r0", "step0_r1"])
def test_the_first_membership(run, name):
    _, steps = run
    s = steps[name]
    assert (s["size"], s["hvd_size"]) == (2, 2)
    assert s["grad"] == [1.5] * 4           # mean of 1 and 2
    assert s["rows"] == [1.0, 2.0]
    assert s["root"] == [1.0] * 4
    assert s["total"] == [3.0]


@pytest.mark.parametrize("step", [1, 2])
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_the_same_graph_in_the_next_membership(run, step, rank):
    _, steps = run
    s = steps[f"step{step}_r{rank}"]
    assert (s["size"], s["rank"]) == (3, rank) and (s["hvd_size"], s["hvd_rank"]) == (3, rank)
    assert s["grad"] == [2.0] * 4           # mean of 1, 2 and 3
    assert s["rows"] == [1.0, 2.0, 3.0]
    assert s["root"] == [1.0] * 4
    assert s["total"] == [6.0]
    # The two first workers ran the graph they traced in the 2-worker
    # membership: traced once, never again.
    assert s["traces"] == 1, s
    assert s["newcomer"] == (rank == 2)


def test_every_worker_ends_with_the_same_weights(run):
    _, steps = run
    finals = {tuple(steps[f"step2_r{rank}"]["w"]) for rank in range(3)}
    # w = -0.5 * (1.5 + 2 + 2) per element after the three steps
    assert finals == {(-2.75,) * 4}, finals
