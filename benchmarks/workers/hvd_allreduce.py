"""Horovod (gloo) all-reduce, the peer a TensorFlow user would pick.

Runs in benchmarks/.hvd-venv (made by benchmarks/setup_horovod.sh), never in
the project's venv: it imports no bps_tf. Launched by `horovodrun --gloo` on
loopback, or by benchmarks/hvd_peer.py inside namespace hosts (horovodrun
would need ssh to reach them). Usage: hvd_allreduce.py SPEC.json (the spec of
benchmarks/workers/bps_numpy.py). Each repetition all-reduces (float32 Sum)
every tensor of the case from one tf.function; Horovod fuses them as it
likes (HOROVOD_FUSION_THRESHOLD). Writes OUT_DIR/worker<rank>.json.
"""
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402


def make_step(label, names):
    @tf.function
    def step(tensors):
        outs = [hvd.allreduce(t, op=hvd.Sum, name=f"{label}.{n}".replace("/", "_"))
                for t, n in zip(tensors, names)]
        # One element of each result keeps every all-reduce live without copying out.
        return tf.add_n([tf.reshape(o, [-1])[0] for o in outs])
    return step


def main():
    spec = json.load(open(sys.argv[1]))
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    results = []
    for case in spec["cases"]:
        names = [n for n, _, _ in case["tensors"]]
        with tf.device("/cpu:0"):
            tensors = [tf.fill(shape, float(rank + 1)) for _, shape, _ in case["tensors"]]
        step = make_step(case["label"], names)
        starts, ends = [], []
        value = None
        for k in range(case["warmup"] + case["reps"]):
            t0 = time.perf_counter()
            value = float(step(tensors))
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
    hvd.shutdown()


if __name__ == "__main__":
    main()
