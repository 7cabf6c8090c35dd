"""The C++ priority pass (bps_tf/ops/priority_pass.cc): the priorities the
push_pull kernels receive, read from the timeline of a 2-worker run, follow the
order the forward pass reads the variables in, not the order they were created.

One cluster (2 workers, 1 server) runs tests/workers/priority_checks.py once.
"""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_runner import ROOT, launch  # noqa: E402

CHECKS = os.path.join(ROOT, "tests", "workers", "priority_checks.py")
# per rank: tensor_name -> {(event name, args.variable)} of its push_pull events
SHOWN = []


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("priority_pass")
    trace_dir = out / "trace"
    env = {"BYTEPS_TRACE_ON": "1", "BYTEPS_TRACE_DIR": str(trace_dir),
           "BYTEPS_TRACE_START_STEP": "0", "BYTEPS_TRACE_END_STEP": "1000"}
    proc = launch(2, 1, [CHECKS, str(out)], env=env, timeout=300)
    tail = f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, tail
    reports, received, labels = [], [], []
    for rank in range(2):
        reports.append(json.loads((out / f"rank{rank}.json").read_text()))
        trace = json.loads((trace_dir / f"bps_trace_rank{rank}.json").read_text())
        got, shown = {}, {}
        for e in trace["traceEvents"]:
            if e.get("cat") == "push_pull":
                got.setdefault(e["args"]["tensor_name"], set()).add(e["args"]["priority"])
                shown.setdefault(e["args"]["tensor_name"], set()).add(
                    (e["name"], e["args"].get("variable")))
        received.append(got)
        labels.append(shown)
    SHOWN[:] = labels
    return reports, received, tail


def _scenario(run, name):
    reports, received, tail = run
    for rank, report in enumerate(reports):
        assert report[name]["ok"], f"rank {rank}: {report[name].get('error')}\n{tail}"
    return [r[name] for r in reports], received


def _variable_priorities(entry, received):
    """variable -> the one priority all its push_pulls were received with."""
    out = {}
    for variable, tensors in entry["tensors"].items():
        seen = set()
        for tensor in tensors:
            assert tensor in received, f"{tensor} not in the timeline: {sorted(received)}"
            seen |= received[tensor]
        assert len(seen) == 1, f"{variable}: {seen}"
        out[variable] = seen.pop()
    return out


def test_strategy_push_pulls_show_their_variable_in_the_timeline(run):
    """The key stays the stable cross-worker name; the event is named after the
    variable it carries (issue: opaque names like bps.strategy/...)."""
    entries, _ = _scenario(run, "fit")
    assert len(SHOWN) == 2
    for entry, shown in zip(entries, SHOWN):
        for variable, tensors in entry["tensors"].items():
            for tensor in tensors:
                ((name, label),) = shown[tensor]
                # the variable's full path (the report shortens it)
                assert name == label and label.endswith(variable), (tensor, shown[tensor])


def test_timeline_events_carry_tensor_name_and_priority(run):
    _, received, _ = run
    for got in received:
        assert got and all(isinstance(p, int) for ps in got.values() for p in ps)


def test_model_fit_priorities_follow_the_call_order(run):
    entries, received = _scenario(run, "fit")
    for entry, got in zip(entries, received):
        priorities = _variable_priorities(entry, got)
        assert sorted(priorities) == sorted(entry["call_order"])
        by_priority = sorted(priorities, key=lambda v: -priorities[v])
        assert by_priority == entry["call_order"]
        assert [priorities[v] for v in entry["call_order"]] == list(range(0, -7, -1))
        assert entry["declared"] != entry["call_order"]    # created in another order
        # the sparse gradient: 4 push_pulls (row counts and rows, of values
        # and of indices), all at the embedding's priority
        assert len(entry["tensors"]["embed/embeddings"]) == 4
    assert _variable_priorities(entries[0], received[0]) == \
        _variable_priorities(entries[1], received[1])


def test_distributed_gradient_tape_priorities_follow_the_call_order(run):
    entries, received = _scenario(run, "tape")
    for entry, got in zip(entries, received):
        priorities = _variable_priorities(entry, got)
        assert sorted(priorities, key=lambda v: -priorities[v]) == entry["call_order"]
        assert [priorities[v] for v in entry["call_order"]] == [0, -1, -2]


def test_a_push_pull_that_is_not_a_gradient_keeps_its_priority(run):
    entries, received = _scenario(run, "user")
    for entry, got in zip(entries, received):
        assert entry["values"] == [4.5, 4.5]               # 1.5 + 3.0
        assert got["PushPull/user_metric"] == {7}


def test_a_graph_without_push_pull_is_left_alone_and_cheap(run):
    entries, _ = _scenario(run, "plain")
    reports, _, _ = run
    for entry, report in zip(entries, reports):
        assert entry["equal"] and entry["graphs_seen"] >= 1
        cost = report["stats"]["without_push_pull"]
        assert cost["graphs"] > 0
        assert cost["total_ns"] / cost["graphs"] < 1e6     # < 1 ms on average
        assert report["stats"]["with_push_pull"]["graphs"] > 0
