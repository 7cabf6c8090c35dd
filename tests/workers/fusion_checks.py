"""Worker script for test_fusion.py: tensor fusion and the TF op's output
buffers across real processes, in one cluster.

    bpslaunch -np 2 --servers 2 python tests/workers/fusion_checks.py OUT_DIR

Values are small integers that depend on the rank and the step, so every
sum is exact in every dtype (float16 and bfloat16 included) and a part
delivered to the wrong tensor, step or offset changes a result. Writes
OUT_DIR/rank<r>.json (check_record).
"""
import sys

import numpy as np
import tensorflow as tf

import bps_tf  # noqa: E402
from bps_tf.runtime import basics
from bps_tf import ops as bps_ops
from check_record import Checks  # noqa: E402

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64]
# Element counts from a scalar to a tensor over the fusion threshold (it
# travels alone), so fused messages mix sizes and padding.
SIZES = [1, 3, 17, 100, 1000, 2500, 7, 64, 333, 4096, 5, 20000]
LARGE = 300_000  # float32, 1.2 MB: several partitions, never fused


def values(rank, i, n, step):
    return (np.arange(n) % 13 + rank + 1 + i % 3 + step) % 29


def expected(size, i, n, step):
    return sum(values(r, i, n, step) for r in range(size))


def tensors_of(rank, step):
    out = []
    for i in range(2 * len(SIZES)):
        dtype = DTYPES[i % len(DTYPES)]
        n = SIZES[i % len(SIZES)]
        out.append(tf.constant(values(rank, i, n, step).astype(dtype.as_numpy_dtype)))
    out.append(tf.constant(values(rank, 99, LARGE, step).astype(np.float32)))
    return out


def check_mixed(rank, size):
    names = [f"mixed/{i}" for i in range(2 * len(SIZES))] + ["mixed/large"]
    # Priorities interleave small and large tensors and tie some of them.
    priorities = [(i * 7) % 5 - 2 for i in range(2 * len(SIZES))] + [1]

    @tf.function
    def step(ts):
        return [bps_ops.push_pull_sum(t, tensor_name=n, priority=p)
                for t, n, p in zip(ts, names, priorities)]

    before = basics.stats()
    for s in range(4):
        got = step(tensors_of(rank, s))
        for i, g in enumerate(got):
            n = LARGE if i == len(got) - 1 else SIZES[i % len(SIZES)]
            want = expected(size, 99 if i == len(got) - 1 else i, n, s)
            if g.dtype != tensors_of(rank, s)[i].dtype:
                raise AssertionError(f"{names[i]}: dtype {g.dtype}")
            if not np.array_equal(np.asarray(g.numpy(), dtype=np.float64), want):
                raise AssertionError(f"step {s}, {names[i]} ({g.dtype.name}, {n}): got "
                                     f"{g.numpy().reshape(-1)[:5]}, want {want[:5]}")
    after = basics.stats()
    sent = after["fused_messages_sent"] - before["fused_messages_sent"]
    received = after["fused_messages_received"] - before["fused_messages_received"]
    if sent == 0 or received == 0:
        raise AssertionError(f"no fused messages: sent {sent}, received {received}")
    return f"fused sent {sent}, received {received}"


def push_pull_fn(name):
    @tf.function
    def f(x):
        return bps_ops.push_pull_sum(x, tensor_name=name)
    return f


def full(rank, step, n=50_000):
    return tf.fill([n], float(rank + 1 + 10 * step))


def want(size, step):
    return float(sum(r + 1 + 10 * step for r in range(size)))


def check_held_result_survives_the_next_step(rank, size):
    f = push_pull_fn("reuse/held")
    x = [full(rank, s) for s in range(3)]
    first = f(x[0])
    copy = first.numpy().copy()
    second = f(x[1])  # the inputs are held by Python: the kernel must find an output
    if not np.array_equal(first.numpy(), copy) or copy[0] != want(size, 0):
        raise AssertionError(f"step 0's result changed: {first.numpy()[:3]} vs {copy[:3]}")
    if second.numpy()[0] != want(size, 1):
        raise AssertionError(f"step 1: {second.numpy()[:3]}")
    # A numpy view of a result, with the tensor itself dropped.
    view = np.asarray(f(x[2]))
    f(x[0])
    if not np.all(view == want(size, 2)):
        raise AssertionError(f"a numpy view of step 2's result changed: {view[:3]}")


def check_result_returned_twice(rank, size):
    @tf.function
    def g(x):
        r = bps_ops.push_pull_sum(x, tensor_name="reuse/twice")
        return r, r

    a, b = g(full(rank, 1))
    c, d = g(full(rank, 2))
    for what, t, s in (("a", a, 1), ("b", b, 1), ("c", c, 2), ("d", d, 2)):
        if not np.all(t.numpy() == want(size, s)):
            raise AssertionError(f"{what}: {t.numpy()[:3]}, want {want(size, s)}")


def check_results_kept_in_a_list(rank, size):
    f = push_pull_fn("reuse/list")
    kept = [f(full(rank, s)) for s in range(12)]
    for s, t in enumerate(kept):
        if not np.all(t.numpy() == want(size, s)):
            raise AssertionError(f"step {s}: {t.numpy()[:3]}, want {want(size, s)}")
    # Eager calls keep their kernel (and its buffer) across calls too.
    eager = [bps_ops.push_pull_sum(full(rank, s), tensor_name="reuse/eager") for s in range(6)]
    for s, t in enumerate(eager):
        if not np.all(t.numpy() == want(size, s)):
            raise AssertionError(f"eager step {s}: {t.numpy()[:3]}")


def address(t):
    return np.asarray(t).__array_interface__["data"][0]


def check_free_buffer_is_reused(rank, size):
    f = push_pull_fn("reuse/free")
    x = full(rank, 1)
    r = f(x)
    first = address(r)
    ok = r.numpy()[0] == want(size, 1)
    del r
    r = f(x)
    second = address(r)
    if not ok or r.numpy()[0] != want(size, 1):
        raise AssertionError("wrong sums")
    if first != second:
        raise AssertionError(f"a result nobody held was not reused: {first:#x} then {second:#x}")
    held = f(x)
    if address(held) == second:
        raise AssertionError("a result still held was handed out again")
    return f"reused {second:#x}"


def main():
    out_dir = sys.argv[1]
    bps_tf.init()
    rank, size = basics.rank(), basics.size()
    checks = Checks(out_dir, rank, size)
    with tf.device("/cpu:0"):
        checks.run("mixed", lambda: check_mixed(rank, size))
        checks.run("held", lambda: check_held_result_survives_the_next_step(rank, size))
        checks.run("twice", lambda: check_result_returned_twice(rank, size))
        checks.run("list", lambda: check_results_kept_in_a_list(rank, size))
        checks.run("reused", lambda: check_free_buffer_is_reused(rank, size))
    checks.run("finished", lambda: None)
    basics.shutdown()


if __name__ == "__main__":
    main()
