"""A Horovod-style elastic script whose @tf.function step is traced once, in
the first membership, and then runs unchanged after a worker joins: run by
tests/test_elastic_graphs.py under `bpslaunch -np 2 --min-np 2 --max-np 3`
with a discovery script that reads HOSTS (rank 0 offers a third slot after
the first step).

Each worker's input is its current rank + 1, so each step's results say
which membership the traced graph ran in: the averaged gradient (the mean
of 1..size), the allgathered rows (1..size), rank 0's broadcast value (1),
size_op and rank_op. Every step is recorded as step<i>_r<rank>.json.
"""
import json
import os
import sys
import time

import tensorflow as tf

import bps_tf as hvd

OUT, HOSTS = sys.argv[1], sys.argv[2]
NEWCOMER = os.environ.get("BYTEPS_ELASTIC_NEWCOMER") == "1"
STEPS = 3

hvd.init()
w = tf.Variable(tf.zeros([4]), name="w")


@tf.function
def step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * x)
    tape = hvd.DistributedGradientTape(tape)
    grad = tape.gradient(loss, [w])[0]
    w.assign_sub(0.5 * grad)
    rows = hvd.allgather(x[:1], name="rows")
    root = hvd.broadcast(x, root_rank=0, name="root_x")
    total = hvd.allreduce(x[:1], op=hvd.Sum, name="total")
    return grad, rows, root, total, hvd.size_op(), hvd.rank_op()


def record(state, out):
    grad, rows, root, total, size, rank = (t.numpy().tolist() for t in out)
    with open(os.path.join(OUT, f"step{state.step}_r{hvd.rank()}.json"), "w") as f:
        json.dump({"grad": grad, "rows": rows, "root": root, "total": total, "size": size,
                   "rank": rank, "hvd_size": hvd.size(), "hvd_rank": hvd.rank(),
                   "newcomer": NEWCOMER, "traces": step.experimental_get_tracing_count(),
                   "w": w.numpy().tolist()}, f)


def offer_third_slot_and_wait(state):
    """Rank 0 offers a slot; every worker commits until the newcomer is
    admitted (HostsUpdatedInterrupt leaves here on every worker at once)."""
    if hvd.rank() == 0:
        with open(HOSTS + ".tmp", "w") as f:
            f.write("localhost:3\n")
        os.replace(HOSTS + ".tmp", HOSTS)
    deadline = time.time() + 150
    while time.time() < deadline:
        state.commit()
        time.sleep(0.2)
    raise RuntimeError("no newcomer joined within 150 s")


state = hvd.elastic.TensorFlowState([w], step=0)


@hvd.elastic.run
def train(state):
    while state.step < STEPS:
        x = tf.fill([4], float(hvd.rank() + 1))
        record(state, step(x))
        state.step += 1
        if state.step == 1 and hvd.size() == 2:
            offer_third_slot_and_wait(state)
        state.commit()


train(state)
