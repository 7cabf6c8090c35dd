"""Worker for test_process_sets.py's core checks (numpy, no TensorFlow).

    bpslaunch -np 3 --servers 2 python tests/workers/process_set_core.py OUT_DIR

Process sets at the core's level: the agreement "set=0,2" makes a sum among
ranks 0 and 2 only. Overlapping sets and global sums run concurrently for
many rounds over several partitions on both servers, checked exactly; a
rank outside a set is refused at once; a set whose member never calls is
reported by the stall check with that member only (the test reads the log).
"""
import sys

import numpy as np

from bps_tf import basics
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
    basics.init()
    core = basics.core()
    rank, size = basics.rank(), basics.size()
    checks = Checks(out_dir, rank, size)
    checks.run("exact_sums", lambda: check_exact_sums(core, rank))
    checks.run("refusals", lambda: check_refusals(core, rank))
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
