"""Worker for test_process_sets.py's core checks (numpy, no TensorFlow).

    bpslaunch -np 3 --servers 2 python tests/workers/process_set_core.py OUT_DIR

Process sets at the core's level: the agreement "set=0,2" makes a sum among
ranks 0 and 2 only. Overlapping sets and global sums run concurrently for
many rounds over several partitions on both servers, checked exactly; a
rank outside a set is refused at once; a set whose member never calls is
reported by the stall check with that member only (the test reads the log).
Join inside sets: a non-member's join changes nothing in a set's sum or
min, a joined member counts as zeros in its set's max (also on a key it
never pushed), and every rank hears the same last joiner.
"""
import sys
import time

import numpy as np

import bps_tf  # noqa: E402
from bps_tf.runtime import basics
from check_record import Checks  # noqa: E402

ROUNDS = 20
ELEMENTS = 3000   # several partitions with BYTEPS_PARTITION_BYTES=4096
SETS = {"s02": [0, 2], "s12": [1, 2], "all": [0, 1, 2]}


def data(rank, name, i):
    seed = {"s02": 1, "s12": 2, "all": 3}[name]
    return (np.arange(ELEMENTS, dtype=np.int64) % 97 * (rank + 1) + 1000 * seed + i)


def check_exact_sums(core, rank):
    for i in range(ROUNDS):
        handles = []
        for name, members in SETS.items():
            if rank not in members:
                continue
            agreement = "" if name == "all" else "set=" + ",".join(map(str, members))
            x = data(rank, name, i)
            out = np.empty_like(x)
            handles.append((name, members, out, core.push_pull_async(
                f"core/{name}", x, out, 0, "", agreement=agreement)))
        for name, members, out, handle in handles:
            handle.wait(60)
            want = sum(data(r, name, i) for r in members)
            if not np.array_equal(out, want):
                raise AssertionError(f"{name} round {i}: wrong sum")
    return str(ROUNDS)


def expect_invalid(core, name, agreement, needle):
    x = np.ones(4, np.float32)
    try:
        core.push_pull_async(name, x, np.empty_like(x), 0, "", agreement=agreement).wait(10)
    except RuntimeError as exc:
        if needle not in str(exc):
            raise AssertionError(f"{agreement}: {exc}") from exc
        return str(exc)
    raise AssertionError(f"{agreement} was accepted")


def check_refusals(core, rank):
    outside = {0: "set=1,2", 1: "set=0,2", 2: "set=0,1"}[rank]
    expect_invalid(core, "core/outside", outside, "is not in its process set")
    expect_invalid(core, "core/bad", "set=0,7", "is not a rising list of ranks")
    return expect_invalid(core, "core/unsorted", "set=2,0", "is not a rising list of ranks")


def run(core, name, x, agreement, reduce_op=0):
    out = np.empty_like(x)
    core.push_pull_async(name, x, out, 0, "", agreement=agreement,
                         reduce_op=reduce_op).wait(60)
    return out


def check_join_in_sets(core, rank):
    """Rank 2 joins first, then rank 1, then rank 0 (1 = min, 2 = max)."""
    x = {0: np.array([-3, 5, 7], np.int64), 1: np.array([4, -6, 7], np.int64)}
    if rank == 2:
        return str(core.join())
    # The global sum completes once rank 2's join reached the servers.
    got = {"global": run(core, "core/js/global", x[rank], "")}
    if rank == 1:
        # Rank 0's pushes arrive first: a server that took the joined
        # non-member for a member would complete them with rank 0's alone.
        time.sleep(0.5)
    got["sum01"] = run(core, "core/js/sum01", x[rank], "set=0,1")
    got["min01"] = run(core, "core/js/min01", x[rank], "set=0,1", reduce_op=1)
    want = {"sum01": x[0] + x[1], "min01": np.minimum(x[0], x[1]), "global": x[0] + x[1]}
    if rank == 1:
        last = core.join()
    else:
        # Rank 1 has joined (now or soon): zeros in its place. A key rank 1
        # never pushed, so the server knows the set only from the header.
        got["max01"] = run(core, "core/js/max01", x[0], "set=0,1", reduce_op=2)
        want["max01"] = np.maximum(x[0], 0)
        got["sum02"] = run(core, "core/js/sum02", x[0], "set=0,2")
        want["sum02"] = x[0]
        last = core.join()
    for name, value in got.items():
        if not np.array_equal(value, want[name]):
            raise AssertionError(f"{name}: {value.tolist()} != {want[name].tolist()}")
    return str(last)


def check_stall(core, rank):
    """Rank 1 calls a set [0, 1] collective that rank 0 never calls."""
    if rank != 1:
        return "not called"
    x = np.ones(4, np.float32)
    try:
        core.push_pull_async("core/stalled", x, np.empty_like(x), 0, "",
                             agreement="set=0,1").wait(5)
    except RuntimeError as exc:   # the timeout of wait: the stall was reported by then
        return str(exc)
    raise AssertionError("a set collective without its member completed")


def main(out_dir):
    bps_tf.init()
    core = basics.core()
    rank, size = basics.rank(), basics.size()
    checks = Checks(out_dir, rank, size)
    checks.run("exact_sums", lambda: check_exact_sums(core, rank))
    checks.run("refusals", lambda: check_refusals(core, rank))
    checks.run("join_in_sets", lambda: check_join_in_sets(core, rank))
    checks.run("stall", lambda: check_stall(core, rank))
    # Everyone stays until rank 1 has seen the report (a peer that leaves
    # would fail its pending sum first).
    end = np.ones(1, np.int32)
    core.push_pull_async("core/end", end, np.empty_like(end), 0, "").wait(60)
    checks.results["finished"] = {"ok": True, "detail": ""}
    checks.write()
    basics.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
