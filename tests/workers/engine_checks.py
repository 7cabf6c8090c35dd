"""Engine checks run by each worker of a numpy-only cluster (no TensorFlow).

Usage: engine_checks.py MODE OUT_DIR. Writes OUT_DIR/rank<r>.json with what
this worker observed; tests/test_engine.py asserts on it.
"""
import json
import os
import random
import sys
import time

import numpy as np

MODE, OUT = sys.argv[1], sys.argv[2]

if MODE == "settings":
    # Worker 1 disagrees with the cluster on the partition size.
    if os.environ.get("DMLC_WORKER_ID") == "1":
        os.environ["BYTEPS_PARTITION_BYTES"] = "1024"
if MODE == "settings_link_rate":
    # Worker 1 alone is told the links' rate, which sizes its partitions.
    if os.environ.get("DMLC_WORKER_ID") == "1":
        os.environ["BYTEPS_LINK_RATE"] = "100mbit"

import bps_tf  # noqa: E402
from bps_tf.runtime import basics  # noqa: E402

result = {}
try:
    bps_tf.init()
except Exception as exc:  # the test asserts on the message
    print(f"bps_tf.init() failed: {exc}", file=sys.stderr, flush=True)
    result["init_error"] = str(exc)
    # Under TF_CONFIG there is no DMLC_WORKER_ID; the pid keeps names apart.
    who = os.environ.get("DMLC_WORKER_ID", f"pid{os.getpid()}")
    with open(os.path.join(OUT, f"rank{who}.json"), "w") as f:
        json.dump(result, f)
    sys.exit(0)

core = basics.core()
rank, size = basics.rank(), basics.size()
result.update(rank=rank, size=size, local_rank=basics.local_rank(), local_size=basics.local_size(),
              cross_rank=basics.cross_rank(), cross_size=basics.cross_size())


def dtype_of(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def start(name, array, priority=0):
    out = np.empty_like(array)
    dt = "bfloat16" if array.dtype.name == "bfloat16" else ""
    return core.push_pull_async(name, array, out, priority, dt), out


def check_sums():
    # The size this node resolved (BYTEPS_PARTITION_BYTES, or BYTEPS_LINK_RATE's).
    from bps_tf.runtime import config
    part = int(config.core_settings()["partition_bytes"])
    result["partition_bytes"] = part
    pending = []
    for dname in ["float16", "bfloat16", "float32", "float64", "int32", "int64"]:
        dt = dtype_of(dname)
        sizes = [0, 1, 7, (1 << 20) // dt.itemsize, (3 * part + 1 + dt.itemsize - 1) // dt.itemsize]
        for n in sizes:
            # Integer values small enough to be exact in every dtype; they
            # depend on the rank so a missing or doubled push shows.
            base = (np.arange(n) % 7).astype(np.float64)
            a = (base + rank + 1).astype(dt)
            expect = (base * size + sum(r + 1 for r in range(size))).astype(dt)
            h, out = start(f"sum/{dname}/{n}", a)
            pending.append((dname, n, h, out, expect))
    # 50 more in flight at once, all different sizes and priorities.
    for i in range(50):
        a = np.full(1000 + 37 * i, float(rank * 100 + i), dtype=np.float32)
        expect = np.full_like(a, sum(r * 100 + i for r in range(size)))
        h, out = start(f"flight/{i}", a, priority=random.Random(i).randint(-5, 5))
        pending.append(("flight", i, h, out, expect))
    bad = []
    for dname, n, h, out, expect in pending:
        h.wait(60)
        if out.tobytes() != expect.tobytes():
            bad.append(f"{dname}/{n}")
    result["checked"] = len(pending)
    result["bad"] = bad


def check_priority():
    # Round 1 declares the tensors; in round 2 worker 0 queues every
    # partition while sends are held, so their order is decided by the
    # priority queue alone, then released under a one-partition credit.
    part = int(os.environ["BYTEPS_PARTITION_BYTES"])
    priorities = [0, 3, -2, 7, 5, 1]
    for round_ in range(2):
        if rank == 0 and round_ == 1:
            core.debug_pause_sends(True)
        handles = []
        for i, prio in enumerate(priorities):
            a = np.full(part // 2, float(rank + i), dtype=np.float32)  # two partitions each
            handles.append(start(f"prio/{i}", a, prio))
        if rank == 0 and round_ == 1:
            core.debug_pause_sends(False)
        for h, _ in handles:
            h.wait(60)
    result["send_log"] = basics.debug_send_log()[-2 * len(priorities):]


def check_mismatch():
    shape = (3, 4) if rank == 0 else (4, 3)
    h, _ = start("mismatch", np.zeros(shape, np.float32))
    try:
        h.wait(60)
        result["error"] = None
    except RuntimeError as exc:
        result["error"] = str(exc)
    # The engine keeps working for other tensors after the error.
    h, out = start("after_mismatch", np.ones(5, np.float32))
    h.wait(60)
    result["after"] = out.tolist()
    # The same name in flight twice is refused at once. Each worker checks
    # its own name, which the other pushes only once this worker has made
    # its second call, so the first cannot have completed in between (a
    # fast server answers a small push in less than a Python call).
    a = np.ones(10, np.float32)
    mine, theirs = f"twice{rank}", f"twice{1 - rank}"
    h1, _ = start(mine, a)
    h2, _ = start(mine, a)
    try:
        h2.wait(60)
        result["twice_error"] = None
    except RuntimeError as exc:
        result["twice_error"] = str(exc)
    open(os.path.join(OUT, f"twice_checked{rank}"), "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(OUT, f"twice_checked{1 - rank}")):
        if time.monotonic() > deadline:
            raise RuntimeError("the other worker never reached the in-flight-twice check")
        time.sleep(0.01)
    start(theirs, a)[0].wait(60)
    h1.wait(60)


def check_too_many_parts():
    # 64-byte partitions: a tensor of 2^16 partitions is refused where it is
    # declared, and a small one after it still sums.
    h, _ = start("too_many_parts", np.zeros(65536 * 16, np.float32))
    try:
        h.wait(60)
        result["error"] = None
    except RuntimeError as exc:
        result["error"] = str(exc)
    h, out = start("after_too_many_parts", np.full(40, rank + 1, np.float32))
    h.wait(60)
    result["after"] = out.tolist()


def check_timeline():
    """Horovod's start_timeline/stop_timeline: only what ran in between is
    recorded; a second start is refused; a stop with nothing recording is None."""
    path = os.path.join(OUT, f"dynamic{rank}", "timeline.json")   # folder made on write
    a = np.ones(1000, np.float32)

    def one(name):
        h, _ = start(name, a)
        h.wait(60)

    one("before")
    basics.start_timeline(path, mark_cycles=True)
    try:
        basics.start_timeline(path)
        result["second_start"] = "accepted"
    except ValueError as exc:
        result["second_start"] = str(exc)
    for _ in range(3):
        one("during")
    result["written"] = basics.stop_timeline()
    one("after")
    result["stop_again"] = basics.stop_timeline()
    result["path"] = path
    # A file that cannot be written is an error, not a quiet None.
    blocker = os.path.join(OUT, f"plain_file{rank}")
    open(blocker, "w").close()
    basics.start_timeline(os.path.join(blocker, "timeline.json"))
    one("during")
    try:
        basics.stop_timeline()
        result["unwritable"] = "no error"
    except OSError as exc:
        result["unwritable"] = str(exc)
    result["stop_after_failure"] = basics.stop_timeline()


def check_rounds():
    # Many rounds of one name while one worker is irregularly slow: each
    # round's sum must be that round's, never a neighbour's.
    rng = random.Random(rank)
    bad = 0
    for r in range(150):
        if rank == 1 and rng.random() < 0.2:
            time.sleep(0.01)
        a = np.full(50000, float(r * 10 + rank), dtype=np.float64)
        h, out = start("rounds", a)
        h.wait(60)
        if not (out == sum(r * 10 + k for k in range(size))).all():
            bad += 1
    result["bad_rounds"] = bad


def check_async():
    # An asynchronous key (name prefix bps_async/): the server keeps the
    # value, every push adds to it and the reply is the stored value, without
    # waiting for the other workers. Synchronous keys beside it still sum
    # per round.
    seen = []
    h, out = start("beside", np.ones(4, np.float32))
    h.wait(60)
    result["sync_beside"] = out.tolist()
    for _ in range(5):
        h, out = start("bps_async/check", np.ones(8, np.float32))
        h.wait(60)
        seen.append(float(out[0]))
    final = seen[-1]
    deadline = time.time() + 20
    while final < 5 * size and time.time() < deadline:
        h, out = start("bps_async/check", np.zeros(8, np.float32))
        h.wait(60)
        final = float(out[0])
        time.sleep(0.05)
    result["seen"] = seen
    result["final"] = final
    # An asynchronous key's first declaration fixes its signature (nobody
    # waits for the others); a different one fails instead of waiting.
    h, _ = start("bps_async/shape", np.zeros((3, 4) if rank == 0 else (4, 3), np.float32))
    try:
        h.wait(60)
        result["async_shape_error"] = None
    except RuntimeError as exc:
        result["async_shape_error"] = str(exc)


def check_reduce_ops():
    # Min, max and product on the servers, exact in every dtype the core
    # carries (products of small integers are exact in the float types;
    # int32/int64 products wrap as numpy's do).
    bad = []
    for dname in ["float16", "bfloat16", "float32", "float64", "int32", "int64"]:
        dt = dtype_of(dname)
        every = [np.array([r + 1, -2 * (r + 1), 3 - r, 1 << (4 * r)], dtype=dt) for r in range(size)]
        if dname in ("int32", "int64"):
            big = 1 << (24 if dname == "int32" else 56)
            every = [np.concatenate([e, np.array([big + r], dtype=dt)])
                     for r, e in enumerate(every)]
        for op, fn in ((1, np.minimum.reduce), (2, np.maximum.reduce), (3, np.multiply.reduce)):
            out = np.empty_like(every[rank])
            core.push_pull_async(f"reduce/{dname}/{op}", every[rank], out, 0,
                                 "bfloat16" if dname == "bfloat16" else "", "",
                                 reduce_op=op).wait(60)
            # numpy widens integer products: narrowed back, they wrap as the type does
            want = fn(np.stack(every).astype(np.float64) if dname == "bfloat16"
                      else np.stack(every), axis=0)
            want = np.asarray(want).astype(np.float64 if dname == "bfloat16" else dt)
            if not np.array_equal(out.astype(np.float64), np.asarray(want).astype(np.float64)):
                bad.append(f"{dname} op {op}: {out.tolist()} != {np.asarray(want).tolist()}")
    nan_in = np.array([np.nan if rank == 1 else 1.0, float(rank)], np.float32)
    out = np.empty_like(nan_in)
    core.push_pull_async("reduce/nan", nan_in, out, 0, "", "", reduce_op=2).wait(60)
    if not (np.isnan(out[0]) and out[1] == size - 1):
        bad.append(f"max with nan: {out.tolist()}")
    try:
        core.push_pull_async("reduce/compressed", np.ones(8, np.float32), np.empty(8, np.float32),
                             0, "", "topk ratio=0.5", reduce_op=1)
        bad.append("a reduce op with compression was accepted")
    except ValueError as exc:
        result["compression_error"] = str(exc)
    h = core.push_pull_async("bps_async/reduce", np.ones(8, np.float32),
                             np.empty(8, np.float32), 0, "", "", reduce_op=1)
    try:
        h.wait(60)
        bad.append("a reduce op on an asynchronous key was accepted")
    except RuntimeError as exc:
        result["async_error"] = str(exc)
    result["bad"] = bad


def check_join():
    # Worker 0 joins at once. Workers 1 and 2 then sum a new tensor, worker 2
    # late: the scheduler waits for worker 2 only (the stall check names it,
    # not the joined worker 0) and the sum is theirs. Then they join, and
    # every worker gets the same last rank.
    if rank == 0:
        result["last"] = core.join()
    else:
        if rank == 2:
            time.sleep(2.5)
        h, out = start("join/late", np.full(4, rank + 1, np.int32))
        h.wait(60)
        result["sum"] = out.tolist()
        result["last"] = core.join()
    # Everyone back: a full sum again.
    h, out = start("join/after", np.full(2, rank + 1, np.int64))
    h.wait(60)
    result["after"] = out.tolist()


def check_join_lost():
    # Worker 0 joins, then hangs (SIGSTOP): joined or not, it stops
    # heartbeating, and the scheduler reports it to the others, which fail
    # instead of waiting in their own join forever.
    if rank == 0:
        import signal
        import threading
        threading.Thread(target=core.join, daemon=True).start()
        time.sleep(1.0)
        with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "stopping": True}, f)
        os.kill(os.getpid(), signal.SIGSTOP)
    # The others train on: their sums complete without worker 0 until the
    # scheduler misses its heartbeats (the launcher then stops the job, so
    # what they saw is written after every step).
    result["sums"] = []
    deadline = time.time() + 30
    while time.time() < deadline:
        h, out = start("join_lost/sum", np.full(3, rank, np.int32))
        h.wait(60)
        result["sums"].append(out.tolist())
        tmp = os.path.join(OUT, f"rank{rank}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, os.path.join(OUT, f"rank{rank}.json"))
        time.sleep(0.1)
    os._exit(0)


{"sums": check_sums, "priority": check_priority, "mismatch": check_mismatch,
 "too_many_parts": check_too_many_parts,
 "rounds": check_rounds, "timeline": check_timeline, "async": check_async, "reduce": check_reduce_ops,
 "join": check_join, "join_lost": check_join_lost}[MODE]()
result["stats"] = {k: v for k, v in basics.stats().items() if k != "send_log"}
with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
basics.shutdown()
