"""Worker script for test_process_sets.py: Horovod process sets in one cluster.

    bpslaunch -np 3 --servers 2 python tests/workers/process_set_checks.py OUT_DIR

Sets: A = [0, 1] (registered by init(process_sets=...)), B = [1, 2] (overlaps
A at rank 1) and D = [2] (disjoint from A), both by add_process_set. Every
collective's expectation is computed with numpy from the members' inputs.
The mismatch checks run last (they leave failed names behind).
"""
import sys
import time

import numpy as np
import tensorflow as tf

import bps_tf
from bps_tf.horovod import api, scatter_gather, synchronization
from check_record import Checks  # noqa: E402

A_RANKS, B_RANKS, D_RANKS = [0, 1], [1, 2], [2]


def expect_equal(what, got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or not np.array_equal(got, want):
        raise AssertionError(f"{what}: got {got.tolist()} ({got.dtype}), want {want.tolist()}")


def value(rank, n=4):
    return np.arange(n, dtype=np.float32) * 10 + rank + 1


def expect_refused(what, fn):
    """Horovod raises InvalidArgumentError; bps_tf's error is also a ValueError."""
    try:
        fn()
    except tf.errors.InvalidArgumentError as exc:
        if "is not in" not in str(exc) or not isinstance(exc, ValueError):
            raise
        return
    raise AssertionError(f"{what}: a rank outside the set was not refused")


def check_registry(rank, sets):
    a, b, d = sets
    assert (a.process_set_id, b.process_set_id, d.process_set_id) == (1, 2, 3), sets
    for ps, ranks in zip(sets, (A_RANKS, B_RANKS, D_RANKS)):
        assert ps.size() == len(ranks) and ps.included() == (rank in ranks), ps
        assert ps.rank() == (ranks.index(rank) if rank in ranks else -1), ps
        assert int(synchronization.size_op(process_set_id=ps.process_set_id)) == len(ranks)
        included = synchronization.process_set_included_op(process_set_id=ps.process_set_id)
        assert included.dtype == tf.int32 and int(included) == int(rank in ranks), ps
    assert bps_tf.global_process_set.size() == 3
    return " ".join(f"{ps.process_set_id}:{ps.size()}:{ps.rank()}" for ps in sets)


def check_eager_collectives(rank, sets):
    """Sum, average, allgather, broadcast, alltoall, reducescatter, grouped
    calls, barrier and objects within sets, interleaved with global calls
    (unnamed: each set numbers its eager calls on its own)."""
    a, b, d = sets
    done = []
    glob = api.allreduce(tf.constant(value(rank)), op=api.Sum)
    expect_equal("global sum 1", glob, sum(value(r) for r in range(3)))
    if rank in A_RANKS:
        x = tf.constant(value(rank))
        expect_equal("A sum", api.allreduce(x, op=api.Sum, process_set=a),
                     sum(value(r) for r in A_RANKS))
        expect_equal("A average", api.allreduce(x, process_set=a),
                     sum(value(r) for r in A_RANKS) / 2)
        ints = tf.constant([7 + rank, -3], tf.int32)
        expect_equal("A int average", api.allreduce(ints, process_set=a), [7, -3])
        # alltoall within A: set rank i sends i + 1 rows to set rank 0, 1 to set rank 1
        me = A_RANKS.index(rank)
        rows = tf.constant(np.full([me + 2, 2], rank, np.int32))
        got, splits = scatter_gather.alltoall(rows, splits=[me + 1, 1], process_set=a)
        want = np.concatenate([np.full([(i + 1) if me == 0 else 1, 2], r, np.int32)
                               for i, r in enumerate(A_RANKS)])
        expect_equal("A alltoall", got, want)
        expect_equal("A alltoall splits", splits, [i + 1 if me == 0 else 1 for i in range(2)])
        grouped = api.grouped_allreduce([x, 2 * x], op=api.Sum, process_set=a)
        expect_equal("A grouped", grouped[1], 2 * sum(value(r) for r in A_RANKS))
        obj = api.broadcast_object({"from": rank}, root_rank=1, process_set=a)
        assert obj == {"from": 1}, obj
        done.append("A")
    else:
        expect_refused("allreduce", lambda: api.allreduce(tf.constant([1.0]), process_set=a))
        expect_refused("alltoall",
                       lambda: scatter_gather.alltoall(tf.constant([1.0]), process_set=a))
    if rank in B_RANKS:
        me = B_RANKS.index(rank)
        rows = tf.constant(np.full([rank + 1, 3], rank, np.int64))
        expect_equal("B allgather", api.allgather(rows, process_set=b),
                     np.concatenate([np.full([r + 1, 3], r, np.int64) for r in B_RANKS]))
        expect_equal("B broadcast from global rank 2",
                     api.broadcast(tf.constant(value(rank)), root_rank=2, process_set=b),
                     value(2))
        try:
            api.broadcast(tf.constant([1.0]), root_rank=0, process_set=b)
            raise AssertionError("a root outside the set was accepted")
        except ValueError as exc:
            assert "not in" in str(exc), exc
        four = tf.constant(np.arange(8, dtype=np.float64).reshape(4, 2) * (rank + 1))
        mine = scatter_gather.reducescatter(four, op=api.Sum, process_set=b)
        total = sum(np.arange(8, dtype=np.float64).reshape(4, 2) * (r + 1) for r in B_RANKS)
        expect_equal("B reducescatter", mine, total[2 * me:2 * me + 2])
        assert synchronization.barrier(process_set=b) is None
        gathered = api.allgather_object(f"r{rank}", process_set=b)
        assert gathered == ["r1", "r2"], gathered
        done.append("B")
    if rank in D_RANKS:
        expect_equal("D sum (one rank)",
                     api.allreduce(tf.constant(value(rank)), op=api.Sum, process_set=d),
                     value(rank))
        done.append("D")
    glob = api.allreduce(tf.constant(value(rank)), op=api.Average)
    expect_equal("global average 2", glob, sum(value(r) for r in range(3)) / 3)
    gathered = api.allgather(tf.constant([[rank]]))
    expect_equal("global allgather", gathered, [[0], [1], [2]])
    return " ".join(done)


def check_same_name_in_disjoint_sets(rank, sets):
    """Ranks 0, 1 (set A) and rank 2 (set D) use one name at the same time."""
    a, _, d = sets
    ps, members = (a, A_RANKS) if rank in A_RANKS else (d, D_RANKS)
    got = api.allreduce(tf.constant(value(rank)), op=api.Sum, name="shared/name",
                        process_set=ps)
    expect_equal("disjoint sets, one name", got, sum(value(r) for r in members))
    return str(len(members))


def check_tf_function_and_gradients(rank, sets):
    """Set collectives traced in a tf.function, and gradients through them."""
    a, b, _ = sets

    @tf.function
    def step(x):
        out = []
        if rank in A_RANKS:
            out.append(api.allreduce(x, op=api.Sum, process_set=a, name="fn/a"))
        if rank in B_RANKS:
            out.append(api.allgather(x, process_set=b, name="fn/b"))
        out.append(api.allreduce(x, op=api.Sum, name="fn/global"))
        return out

    results = step(tf.constant(value(rank)))
    want = []
    if rank in A_RANKS:
        want.append(sum(value(r) for r in A_RANKS))
    if rank in B_RANKS:
        want.append(np.concatenate([value(r) for r in B_RANKS]))
    want.append(sum(value(r) for r in range(3)))
    for i, (got, expected) in enumerate(zip(results, want)):
        expect_equal(f"tf.function result {i}", got, expected)
    if rank in A_RANKS:
        w = tf.Variable(value(rank))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w * float(rank + 1))
        tape = bps_tf.DistributedGradientTape(tape, process_set=a)
        (grad,) = tape.gradient(loss, [w])
        want = sum(2 * value(r) * (r + 1) for r in A_RANKS) / 2
        expect_equal("DistributedGradientTape average over A", grad, want)
        with tf.GradientTape() as tape:
            x = tf.constant(value(rank))
            tape.watch(x)
            y = api.allreduce(x, op=api.Sum, process_set=a, name="grad/a")
            loss = tf.reduce_sum(y * float(rank + 1))
        # d loss_total / d x: the sum over A of each member's output gradient
        expect_equal("gradient of a set allreduce", tape.gradient(loss, x),
                     np.full([4], sum(r + 1 for r in A_RANKS), np.float32))
    else:
        # Outside the set, as in Horovod: the tape keeps this worker's gradient.
        w = tf.Variable(value(rank))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w * float(rank + 1))
        tape = bps_tf.DistributedGradientTape(tape, process_set=a)
        expect_equal("tape outside the set", tape.gradient(loss, [w])[0],
                     2 * value(rank) * (rank + 1))
    if rank in D_RANKS:
        # Alone in a set: no exchange, no scaling (Horovod's rule).
        w = tf.Variable(value(rank))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * 3.0)
        tape = bps_tf.DistributedGradientTape(tape, process_set=sets[2],
                                              gradient_predivide_factor=2.0)
        expect_equal("tape alone in a set", tape.gradient(loss, [w])[0], np.full([4], 3.0))
    return "ok"


def check_reduce_ops_in_sets(rank, sets):
    """Min, Max and Product on the servers within a set, and a Product's
    gradient (the product of the other members' inputs)."""
    a, b, _ = sets
    if rank in B_RANKS:
        x = tf.constant(value(rank) - 12)
        ins = [value(r) - 12 for r in B_RANKS]
        for op, want in ((api.Min, np.minimum(*ins)), (api.Max, np.maximum(*ins)),
                         (api.Product, ins[0] * ins[1])):
            expect_equal(f"B {op.name}", api.allreduce(x, op=op, process_set=b), want)
    if rank in A_RANKS:
        with tf.GradientTape() as tape:
            x = tf.constant(value(rank))
            tape.watch(x)
            y = api.allreduce(x, op=api.Product, process_set=a, name="grad/prod_a")
            loss = tf.reduce_sum(y)
        other = value(A_RANKS[1 - A_RANKS.index(rank)])
        expect_equal("A product", y, value(0) * value(1))
        # Each member's output gradient is 1: their sum (2) times the other's input.
        expect_equal("gradient of a set product", tape.gradient(loss, x), 2 * other)
    return "ok"


def check_keras_optimizer(rank, sets):
    """A Keras 3 DistributedOptimizer over set A averages A's gradients."""
    import keras
    import bps_tf.keras as bps_keras
    a = sets[0]
    w = keras.Variable(np.ones(4, np.float32), name="ps_w")
    opt = bps_keras.DistributedOptimizer(keras.optimizers.SGD(1.0), process_set=a)
    opt.apply([tf.constant(value(rank))], [w])
    if rank not in A_RANKS:   # Horovod's rule: outside the set, its own gradient
        expect_equal("SGD step outside the set", w.numpy(), 1.0 - value(rank))
        return "outside"
    expect_equal("SGD step with A's average", w.numpy(),
                 1.0 - sum(value(r) for r in A_RANKS) / 2)
    return "ok"


def check_tf1_session(rank, sets):
    """A set allreduce in a tf.compat.v1 graph run by a Session."""
    _, b, _ = sets
    if rank not in B_RANKS:
        return "outside"
    graph = tf.Graph()
    with graph.as_default():
        y = api.allreduce(tf.constant(value(rank)), op=api.Sum, process_set=b, name="tf1/b")
        with tf.compat.v1.Session(graph=graph) as sess:
            got = sess.run(y)
    expect_equal("TF1 session", got, sum(value(r) for r in B_RANKS))
    return "ok"


def check_id_reuse(rank, sets):
    """Horovod's registry: a removed set's id goes to the next set added,
    sets print as in Horovod, hvd.mpi_ops._basics lists them. The new set's
    unnamed eager calls must not meet the removed set's (same id, new keys)."""
    a, b, d = sets
    listed = bps_tf.mpi_ops._basics._get_process_set_ids_and_ranks()
    assert listed == {0: [0, 1, 2], 1: A_RANKS, 2: B_RANKS, 3: D_RANKS}, listed
    assert repr(bps_tf.global_process_set) == \
        "ProcessSet(process_set_id=0, ranks=[0, 1, 2], mpi_comm=None)", repr(bps_tf.global_process_set)
    assert bps_tf.remove_process_set(b) and b.process_set_id is None
    e = bps_tf.add_process_set([0, 2])
    assert e.process_set_id == 2, e      # B's id, reused
    assert repr(e) == "ProcessSet(process_set_id=2, ranks=[0, 2], mpi_comm=None)", repr(e)
    if rank in (0, 2):
        got = api.allreduce(tf.constant(value(rank)), op=api.Sum, process_set=e)
        expect_equal("E sum", got, value(0) + value(2))
    assert bps_tf.remove_process_set(e)
    b2 = bps_tf.add_process_set(B_RANKS)
    assert b2.process_set_id == 2, b2
    return "ok"


def expect_error_on_every_rank(what, fn, *needles):
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:   # the scheduler's error, as TensorFlow raises it
        message = str(exc)
        missing = [n for n in needles if n not in message]
        if missing:
            raise AssertionError(f"{what}: error lacks {missing}: {message}")
        return f"{time.monotonic() - start:.2f} {message}"
    raise AssertionError(f"{what}: did not fail")


def check_op_mismatch(rank):
    op = api.Sum if rank == 0 else api.Average
    return expect_error_on_every_rank(
        "Sum vs Average", lambda: api.allreduce(tf.constant([1.0, 2.0]), op=op, name="mm/op"),
        "mm/op", "op=sum", "op=average")


def check_min_max_mismatch(rank):
    op = api.Min if rank == 0 else api.Max
    return expect_error_on_every_rank(
        "Min vs Max", lambda: api.allreduce(tf.constant([1.0, 2.0]), op=op, name="mm/minmax"),
        "mm/minmax", "op=min", "op=max")


def check_set_mismatch(rank, sets):
    """Ranks 0 and 1 clash at once; rank 2 declares after the clash and
    must get the same error instead of waiting for the others."""
    ps = sets[0] if rank == 0 else bps_tf.global_process_set
    if rank == 2:
        time.sleep(1.0)
    return expect_error_on_every_rank(
        "process set mismatch",
        lambda: api.allreduce(tf.constant([1.0]), op=api.Sum, name="mm/set", process_set=ps),
        "mm/set", "process set [0,1]", "the global process set")


def check_add_process_set_mismatch(rank):
    ranks = [0, 2] if rank == 0 else [1]
    try:
        bps_tf.add_process_set(ranks)
    except ValueError as exc:
        message = str(exc)
        assert "ranks=0,2" in message and "ranks=1" in message, message
        return message
    raise AssertionError("add_process_set with different ranks did not fail")


def main(out_dir):
    a = bps_tf.ProcessSet(A_RANKS)
    bps_tf.init(process_sets=[a])
    rank, size = bps_tf.rank(), bps_tf.size()
    checks = Checks(out_dir, rank, size)
    b = bps_tf.add_process_set(bps_tf.ProcessSet(B_RANKS))
    d = bps_tf.add_process_set(D_RANKS)
    sets = (a, b, d)
    checks.run("registry", lambda: check_registry(rank, sets))
    checks.run("eager", lambda: check_eager_collectives(rank, sets))
    checks.run("disjoint_same_name", lambda: check_same_name_in_disjoint_sets(rank, sets))
    checks.run("tf_function", lambda: check_tf_function_and_gradients(rank, sets))
    checks.run("reduce_ops", lambda: check_reduce_ops_in_sets(rank, sets))
    checks.run("keras_optimizer", lambda: check_keras_optimizer(rank, sets))
    checks.run("tf1_session", lambda: check_tf1_session(rank, sets))
    checks.run("id_reuse", lambda: check_id_reuse(rank, sets))
    checks.run("op_mismatch", lambda: check_op_mismatch(rank))
    checks.run("min_max_mismatch", lambda: check_min_max_mismatch(rank))
    checks.run("set_mismatch", lambda: check_set_mismatch(rank, sets))
    checks.run("add_mismatch", lambda: check_add_process_set_mismatch(rank))
    checks.results["finished"] = {"ok": True, "detail": ""}
    checks.write()


if __name__ == "__main__":
    main(sys.argv[1])
