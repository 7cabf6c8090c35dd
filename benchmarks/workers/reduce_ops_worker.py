"""Worker of benchmarks/reduce_ops.py: times eager allreduce with Sum, Max and
Product (computed by the servers) against the allgather path Min/Max/Product
took before (every worker gathers every worker's tensor and reduces it)."""
import json
import sys
import time

import numpy as np
import tensorflow as tf

import bps_tf
from bps_tf.horovod import api


def timed(fn, reps):
    fn()  # declare the keys outside the timing
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(sizes_mib, reps):
    bps_tf.init()
    rows = []
    for mib in sizes_mib:
        x = tf.random.uniform([int(mib * (1 << 20)) // 4], seed=bps_tf.rank())
        row = {"MiB": mib}
        for label, op in (("sum", api.Sum), ("max", api.Max), ("product", api.Product)):
            row[label] = timed(lambda: api.allreduce(x, op=op, name=f"bench/{label}/{mib}").numpy(),
                               reps)
        row["max_by_allgather"] = timed(
            lambda: tf.reduce_max(api.allgather(x[None], name=f"bench/gather/{mib}"), 0).numpy(),
            reps)
        rows.append(row)
    if bps_tf.rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    bps_tf.shutdown()


if __name__ == "__main__":
    main([float(s) for s in sys.argv[1].split(",")], int(sys.argv[2]))
