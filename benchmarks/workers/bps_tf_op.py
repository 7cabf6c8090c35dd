"""bps_tf worker through the TensorFlow op: times `push_pull_sum` of every
tensor of a case from one tf.function (the ops overlap, as in a train step).

Usage: bps_tf_op.py SPEC.json; same spec and output as bps_numpy.py.
"""
import json
import os
import sys
import time

import tensorflow as tf

import bps_tf  # noqa: E402
from bps_tf.runtime import basics
from bps_tf import ops as bps_ops


# BPS_BENCH_TF_INPUTS=variables: the tensors are variables the function
# reads, as a train step's gradients are computed inside it; the default
# passes them as arguments, and converting 64 Python arguments costs the
# call about 0.8 ms by itself (docs/performance-history.md, "The TF op's output
# buffer and tensor fusion").
IN_GRAPH = os.environ.get("BPS_BENCH_TF_INPUTS", "arguments") == "variables"


def make_step(label, names, priorities, tensors):
    def body(inputs):
        outs = [bps_ops.push_pull_sum(t, tensor_name=f"{label}/{n}", priority=p)
                for t, n, p in zip(inputs, names, priorities)]
        # One element of each result keeps every op live without copying out.
        return tf.add_n([tf.reshape(o, [-1])[0] for o in outs])
    if IN_GRAPH:
        variables = [tf.Variable(t, trainable=False) for t in tensors]
        return tf.function(lambda: body([v.read_value() for v in variables]))
    step = tf.function(body)
    return lambda: step(tensors)


def main():
    spec = json.load(open(sys.argv[1]))
    bps_tf.init()
    rank, size = basics.rank(), basics.size()
    results = []
    for case in spec["cases"]:
        names = [n for n, _, _ in case["tensors"]]
        priorities = [int(p) for _, _, p in case["tensors"]]
        with tf.device("/cpu:0"):
            tensors = [tf.fill(shape, float(rank + 1)) for _, shape, _ in case["tensors"]]
            step = make_step(case["label"], names, priorities, tensors)
        starts, ends = [], []
        value = None
        for k in range(case["warmup"] + case["reps"]):
            t0 = time.perf_counter()
            value = float(step())
            t1 = time.perf_counter()
            if k + 1 == case["warmup"] and case.get("warm_file"):
                # A profiler may start now (benchmarks/profile_push_pull.py).
                open(case["warm_file"].format(rank=rank), "w").close()
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
    basics.shutdown()


if __name__ == "__main__":
    main()
