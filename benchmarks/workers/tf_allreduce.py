"""TensorFlow's own collective all-reduce, the baseline bps_tf must beat.

Usage (one process per TF_CONFIG `worker` task): tf_allreduce.py SPEC.json.
MultiWorkerMirroredStrategy with CommunicationImplementation.RING; each
repetition all-reduces (SUM) every tensor of the case in one call from a
tf.function -- the replica-context `all_reduce` Keras' optimizer uses, which
lets TensorFlow pack the tensors into as few collectives as it likes.
spec["tf_api"] = "reduce_to" instead times `strategy.extended.reduce_to`
per tensor. Writes OUT_DIR/worker<rank>.json.
"""
import json
import os
import sys
import time

import tensorflow as tf

ReduceOp = tf.distribute.ReduceOp


def make_step(strategy, tensors, api):
    if api == "reduce_to":
        @tf.function
        def step():
            per_replica = strategy.run(lambda: [tf.identity(t) for t in tensors])
            reduced = [strategy.extended.reduce_to(ReduceOp.SUM, v, destinations=v)
                       for v in per_replica]
            return tf.add_n([tf.reshape(r, [-1])[0] for r in reduced])
        return step

    @tf.function
    def step():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            reduced = ctx.all_reduce(ReduceOp.SUM, [tf.identity(t) for t in tensors])
            # One element of each result is enough to make every collective run.
            return tf.add_n([tf.reshape(r, [-1])[0] for r in reduced])
        return strategy.run(replica_fn)
    return step


def main():
    spec = json.load(open(sys.argv[1]))
    rank = int(os.environ["BENCH_RANK"])
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    size = strategy.num_replicas_in_sync
    results = []
    for case in spec["cases"]:
        with tf.device("/cpu:0"):
            tensors = [tf.fill(shape, float(rank + 1)) for _, shape, _ in case["tensors"]]
        step = make_step(strategy, tensors, spec.get("tf_api", "all_reduce"))
        starts, ends = [], []
        value = None
        for k in range(case["warmup"] + case["reps"]):
            t0 = time.perf_counter()
            value = float(step())
            t1 = time.perf_counter()
            if k >= case["warmup"]:
                starts.append(t0)
                ends.append(t1)
        expect = len(tensors) * size * (size + 1) / 2
        results.append({"label": case["label"], "starts": starts, "ends": ends,
                        "correct": abs(value - expect) < 1e-3 * expect,
                        "bytes": int(sum(t.shape.num_elements() * 4 for t in tensors))})
    out = os.path.join(spec["out_dir"], f"worker{rank}.json")
    with open(out + ".tmp", "w") as f:
        json.dump({"rank": rank, "size": size, "cases": results}, f)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main()
