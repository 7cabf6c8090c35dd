"""Worker script for tests/test_local_reduce.py: local reduce in one cluster.

    bpslaunch -np 4 --servers 2 python tests/workers/local_reduce_checks.py MODE OUT_DIR

Before init, workers 0-1 say they are on host 127.0.0.1 and workers 2-3 on
127.0.0.2 (DMLC_NODE_HOST), so the scheduler groups them as two hosts of two
workers on one machine. MODE "on" runs the numpy and TensorFlow checks with
local reduce, then worker 1 dies and worker 0 must get a clear error;
"off" (BYTEPS_LOCAL_REDUCE=0) runs the numpy checks with every worker pushing;
"netns" runs the numpy checks on hosts the caller placed in network namespaces.
Writes OUT_DIR/rank<r>.json (check_record.py).
"""
import os
import sys
import time

import numpy as np

MODE, OUT = sys.argv[1], sys.argv[2]
RANK = int(os.environ["DMLC_WORKER_ID"])
if MODE in ("on", "off"):
    os.environ["DMLC_NODE_HOST"] = "127.0.0.1" if RANK < 2 else "127.0.0.2"
    os.environ["BYTEPS_LOCAL_RANK"] = str(RANK % 2)
    os.environ["BYTEPS_LOCAL_SIZE"] = "2"

import bps_tf  # noqa: E402
from bps_tf.runtime import basics  # noqa: E402
from check_record import Checks  # noqa: E402

bps_tf.init()
core = basics.core()
rank, size = basics.rank(), basics.size()
checks = Checks(OUT, rank, size)
DTYPES = ["float16", "float32", "float64", "int32", "int64"]


def start(name, array, priority=0):
    out = np.empty_like(array)
    return core.push_pull_async(name, array, out, priority, ""), out


def values(n, dtype, r):
    """Small integers, exact in every dtype; a missing or doubled worker shows."""
    return ((np.arange(n) % 5) * (r + 1) + r).astype(dtype)


def expected(n, dtype):
    return sum(values(n, np.int64, r) for r in range(size)).astype(dtype)


def numpy_sums():
    part = int(os.environ["BYTEPS_PARTITION_BYTES"])
    pending = []
    for dname in DTYPES:
        dt = np.dtype(dname)
        for n in [0, 1, 7, 1000, (3 * part) // dt.itemsize + 3]:
            h, out = start(f"np/{dname}/{n}", values(n, dt, rank), priority=n % 3)
            pending.append((dname, n, h, out))
    for step in range(3):  # rounds of one name reuse the shared memory
        h, out = start("np/rounds", values(100, np.float32, rank + step))
        h.wait(60)
        want = sum(values(100, np.int64, r + step) for r in range(size)).astype(np.float32)
        assert out.tobytes() == want.tobytes(), f"round {step}: {out[:5]} != {want[:5]}"
    bad = []
    for dname, n, h, out in pending:
        h.wait(60)
        if out.tobytes() != expected(n, np.dtype(dname)).tobytes():
            bad.append(f"{dname}/{n}: {out[:4]}")
    assert not bad, f"wrong sums: {bad}"
    return f"{len(pending)} tensors"


def shape_mismatch():
    shape = (3, 4) if rank != 1 else (4, 3)
    h, _ = start("np/mismatch", np.zeros(shape, np.float32))
    try:
        h.wait(60)
    except RuntimeError as exc:
        return str(exc)
    raise AssertionError("a shape that differs on one host was summed")


def priorities_kept():
    """The root pushes each host sum with its operation's priority."""
    log = [e for e in basics.debug_send_log() if e[0].startswith("np/")]
    if basics.local_rank() != 0:
        assert not log, f"a member pushed: {log[:3]}"
        return {"pushed": 0}
    want = {e[0]: (int(e[0].rsplit("/", 1)[1]) % 3 if e[0][-1].isdigit() else 0) for e in log}
    wrong = [e for e in log if e[2] != want[e[0]]]
    assert log and not wrong, f"pushed with another priority: {wrong[:3]}"
    return {"pushed": len(log)}


def shared_maps():
    with open("/proc/self/maps") as f:
        return sum("bps_tf_local_reduce" in line for line in f)


def memory_follows_bytes_in_flight():
    """New names (unnamed eager calls) reuse the memfds of finished ones."""
    before = shared_maps()
    for i in range(40):
        h, out = start(f"np/seq/{i}", values(1000, np.float32, rank))
        h.wait(60)
        assert out.tobytes() == expected(1000, np.float32).tobytes(), i
    after = shared_maps()
    # Counted before this barrier: a member that went on to the next check
    # (64 in flight: new memfds) would otherwise grow its root's count
    # before the root has read it.
    h, _ = start("np/seq/counted", values(1000, np.float32, rank))
    h.wait(60)
    return {"before": before, "after": after}


def fused_host_sums():
    """Many small host sums leave the root fused (kPushFused); each fused
    part carries contributors = hosts, so the servers complete its round
    with one push per host and the sums stay exact."""
    root = basics.local_rank() == 0
    for step in range(2):  # the first declares the names; the second is counted
        before = stats()
        if root and step == 1:
            core.debug_pause_sends(True)  # queue host sums so that they travel together
        pending = []
        for i in range(64):
            x = values(100 + i, np.float32, rank + step)
            pending.append(start(f"np/fused/{i}", x, priority=i % 4))
        if root and step == 1:
            time.sleep(1.0)
            core.debug_pause_sends(False)
        for i, (h, out) in enumerate(pending):
            h.wait(60)
            want = sum(values(100 + i, np.int64, r + step) for r in range(size)).astype(np.float32)
            assert out.tobytes() == want.tobytes(), f"np/fused/{i} round {step}: {out[:4]}"
    return {k: stats()[k] - before[k] for k in ("partitions_sent", "fused_messages_sent")}


def compressed_bypass():
    """A compressed push_pull skips the host sum: every worker pushes it."""
    before = stats()["partitions_sent"]
    x = np.zeros(10000, np.float32)
    x[:4000] = rank + 1  # exactly the 40 % topk keeps, so the sum is exact
    out = np.empty_like(x)
    core.push_pull_async("np/topk", x, out, 0, "", "topk ratio=0.4").wait(60)
    want = np.zeros_like(x)
    want[:4000] = sum(r + 1 for r in range(size))
    assert out.tobytes() == want.tobytes(), out[:5]
    return {"partitions_sent": stats()["partitions_sent"] - before}


def stats():
    return basics.stats()


def sets_min_broadcast_join():
    """Process-set sums and Min bypass the host sum (each worker pushes its
    own value, so they stay exact); a broadcast keeps it and is exact;
    join() is refused on every rank instead of hanging."""
    import tensorflow as tf
    import bps_tf
    ps = bps_tf.add_process_set([1, 2, 3])  # splits host A, spans host B
    x = tf.constant(values(1000, np.float32, rank))
    before = stats()["partitions_sent"]
    if rank in (1, 2, 3):
        got = bps_tf.allreduce(x, op=bps_tf.Sum, name="lr/set_sum", process_set=ps).numpy()
        want = sum(values(1000, np.int64, r) for r in (1, 2, 3)).astype(np.float32)
        assert np.array_equal(got, want), got[:5]
    set_sent = stats()["partitions_sent"] - before
    before = stats()["partitions_sent"]
    m = bps_tf.allreduce(tf.constant([rank, -rank, 5], tf.int32), op=bps_tf.Min,
                         name="lr/min").numpy()
    assert m.tolist() == [0, -(size - 1), 5], m
    min_sent = stats()["partitions_sent"] - before
    b = bps_tf.broadcast(tf.fill([7], float(rank)), root_rank=2, name="lr/bcast").numpy()
    assert b.tolist() == [2.0] * 7, b
    try:
        bps_tf.join()
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        join_error = str(exc)
    else:
        raise AssertionError("join() ran under local reduce")
    return {"set_sent": set_sent, "min_sent": min_sent, "join_error": join_error}


def tf_sums():
    import tensorflow as tf
    import bps_tf
    tf_dtypes = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64]
    tensors = []
    for i in range(48):
        dt = tf_dtypes[i % len(tf_dtypes)]
        n = [1, 33, 1000, 70000][i % 4]
        tensors.append(tf.cast(values(n, np.int64, rank), dt))

    @tf.function
    def step(xs):
        return [bps_tf.push_pull(x, average=False, name=f"tf/{i}", priority=i % 5)
                for i, x in enumerate(xs)]

    for _ in range(2):
        outs = step(tensors)
    for i, (x, y) in enumerate(zip(tensors, outs)):
        want = tf.cast(expected(int(x.shape[0]), np.int64), x.dtype).numpy()
        got = y.numpy()
        assert got.dtype == want.dtype and np.array_equal(got, want), f"tf/{i} {x.dtype}: {got[:4]}"
    # An average divides by the global size.
    avg = bps_tf.push_pull(tf.fill([10], float(rank)), average=True, name="tf/avg").numpy()
    assert np.allclose(avg, sum(range(size)) / size), avg
    return f"{len(tensors)} tensors, {len(set(t.dtype for t in tensors))} dtypes"


checks.run("init", lambda: {"local_rank": basics.local_rank(), "local_size": basics.local_size(),
                            "cross_rank": basics.cross_rank(), "cross_size": basics.cross_size(),
                            "homogeneous": basics.is_homogeneous()})
before = stats()
checks.run("numpy_sums", numpy_sums)
if MODE == "on":
    checks.run("priorities_kept", priorities_kept)
checks.run("stats_after_numpy", lambda: {k: stats()[k] - before[k] for k in
                                         ("partitions_sent", "local_reduce_ops", "ops_done")})
if MODE == "on":
    checks.run("memory_follows_bytes_in_flight", memory_follows_bytes_in_flight)
    checks.run("fused_host_sums", fused_host_sums)
if MODE in ("off", "netns"):
    basics.shutdown()
    sys.exit(0)
checks.run("tf_sums", tf_sums)
checks.run("compressed_bypass", compressed_bypass)
checks.run("sets_min_broadcast_join", sets_min_broadcast_join)
checks.run("shape_mismatch", shape_mismatch)
# Last: worker 1 dies; its root must fail with a clear error, not wait.
if rank == 1:
    checks.run("dies", lambda: "exiting")
    sys.stdout.flush()
    os._exit(0)
if rank == 0:
    def peer_death():
        t0 = time.time()
        h, _ = start("np/after_death", np.ones(10, np.float32))
        try:
            h.wait(60)
        except RuntimeError as exc:
            return {"error": str(exc), "seconds": time.time() - t0}
        raise AssertionError("push_pull completed although worker 1 died")
    checks.run("peer_death", peer_death)
os._exit(0)
