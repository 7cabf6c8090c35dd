"""The timeline (BYTEPS_TRACE_ON) is well-formed Chrome-trace JSON whose
stage events nest inside their push_pull."""
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_runner import ROOT, launch  # noqa: E402

CHECKS = os.path.join(ROOT, "tests", "workers", "engine_checks.py")
STAGES = ["queue", "push", "server", "copy out"]


def test_start_and_stop_timeline_record_only_what_ran_in_between(tmp_path):
    """Horovod's hvd.start_timeline(path) / hvd.stop_timeline() at run time."""
    proc = launch(2, 1, [CHECKS, "timeline", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            result = json.load(f)
        assert result["written"] == result["path"], result
        assert "being recorded already" in result["second_start"], result
        assert result["stop_again"] is None
        assert result["unwritable"].startswith("cannot write the timeline to "), result
        assert result["stop_after_failure"] is None   # recording stopped all the same
        with open(result["path"]) as f:
            trace = json.load(f)
        ops = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "push_pull"]
        assert sorted((e["name"], e["args"]["step"]) for e in ops) == \
            [("during", 0), ("during", 1), ("during", 2)], ops


def test_timeline_events_are_well_formed_and_nested(tmp_path):
    trace_dir = tmp_path / "trace"
    env = {"BYTEPS_PARTITION_BYTES": str(64 * 1024), "BYTEPS_TRACE_ON": "1",
           "BYTEPS_TRACE_DIR": str(trace_dir), "BYTEPS_TRACE_START_STEP": "2",
           "BYTEPS_TRACE_END_STEP": "5"}
    proc = launch(2, 2, [CHECKS, "rounds", str(tmp_path)], env=env)
    assert proc.returncode == 0, proc.stderr
    for rank in range(2):
        with open(trace_dir / f"bps_trace_rank{rank}.json") as f:
            trace = json.load(f)
        events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
                 if e["ph"] == "M" and e["name"] == "thread_name"}
        for e in events:
            assert {"name", "cat", "ts", "dur", "pid", "tid", "args"} <= set(e)
            assert e["pid"] == rank and e["dur"] >= 0 and isinstance(e["ts"], int)
        ops = [e for e in events if e["cat"] == "push_pull"]
        assert sorted(e["args"]["step"] for e in ops) == [2, 3, 4, 5]  # one tensor, steps 2..5
        assert all(e["name"] == "rounds" and e["args"]["partitions"] == 7 for e in ops)
        by_step = {e["args"]["step"]: e for e in ops}
        rows = defaultdict(list)
        for e in events:
            if e["cat"] == "stage" and e["name"] != "declare":
                rows[(e["tid"], e["args"]["step"])].append(e)
        assert len(rows) == 4 * 7  # every partition of every traced step
        assert any(e["name"] == "server sum" for e in events)
        for (tid, step), stages in rows.items():
            assert names[tid].startswith("rounds / part ")
            op = by_step[step]
            main = [e for e in stages if e["name"] != "server sum"]
            assert [e["name"] for e in sorted(main, key=lambda e: e["ts"])] == STAGES
            prev_end = None
            for e in sorted(main, key=lambda e: e["ts"]):
                assert op["ts"] <= e["ts"] and e["ts"] + e["dur"] <= op["ts"] + op["dur"]
                if prev_end is not None:
                    assert e["ts"] >= prev_end
                prev_end = e["ts"] + e["dur"]
            server = next(e for e in main if e["name"] == "server")
            for s in (e for e in stages if e["name"] == "server sum"):
                assert server["ts"] <= s["ts"] and s["ts"] + s["dur"] <= server["ts"] + server["dur"]
