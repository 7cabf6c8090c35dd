"""Worker script for test_strategy.py: rank 0 calls next() on a distributed
iterator once more than rank 1 (a call made by some ranks only), in a traced
step whose only cross-worker operation is the end-of-data sum.

    bpslaunch -np 2 --servers 1 python tests/workers/data_check_extra_call.py

With the early end-of-data check nothing waits for that last sum; it must
still be reported, at rank 0's exit, instead of being lost.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import bps_tf  # noqa: E402

strategy = bps_tf.BytePSStrategy()
dataset = strategy.distribute_datasets_from_function(
    lambda ctx: tf.data.Dataset.range(20).batch(1))


@tf.function
def step(iterator):
    return strategy.experimental_local_results(next(iterator))[0]


iterator = iter(dataset)
for _ in range(3 if strategy.rank == 0 else 2):
    step(iterator)
print(f"rank {strategy.rank}: steps done", flush=True)
