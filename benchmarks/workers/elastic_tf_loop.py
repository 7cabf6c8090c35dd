"""An elastic TensorFlow training loop for benchmarks/elastic_recovery.py:
``hvd.elastic.run`` around a ``tf.function`` step (DistributedGradientTape,
a small Keras model), committed every batch. Writes the same event lines
as tests/workers/elastic_hosts.py (``kill``, ``step`` after each
membership's first step, ``done``) to ``--times``.
"""
import argparse
import json
import os
import signal
import time

import tensorflow as tf

import bps_tf as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--logfile", required=True)
parser.add_argument("--times", required=True)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batches-per-epoch", type=int, default=10)
parser.add_argument("--batch-wait", type=float, default=0.0)
parser.add_argument("--kill-schedule", default="{}")
args = parser.parse_args()
LAUNCH_ID = os.environ.get("BYTEPS_LAUNCH_ID", "")
START_RANK = int(os.environ.get("HOROVOD_RANK", "0"))
kills = json.loads(args.kill_schedule)

hvd.init()
data = tf.random.stateless_uniform([32, 8], seed=[1, 2])
target = tf.random.stateless_uniform([32, 1], seed=[3, 4])
model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(16, activation="tanh"),
                             tf.keras.layers.Dense(1)])
optimizer = tf.keras.optimizers.SGD(0.01)
optimizer.build(model.trainable_variables)


def note(event, **data_):
    with open(args.times, "a") as f:
        f.write(json.dumps(dict(data_, event=event, time=time.time(), start_rank=START_RANK,
                                launch_id=LAUNCH_ID)) + "\n")


def make_step():
    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(data, training=True) - target) ** 2)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return step


holder = {"step": make_step()}


@hvd.elastic.run
def train(state):
    first = True
    while state.epoch < args.epochs:
        while state.batch < args.batches_per_epoch:
            if LAUNCH_ID in kills.get(str((state.epoch, state.batch)), []):
                note("kill")
                os.kill(os.getpid(), signal.SIGKILL)
            holder["step"]()
            if first:
                note("step", rank=hvd.rank(), size=hvd.size(), epoch=state.epoch,
                     batch=state.batch)
                first = False
            if args.batch_wait:
                time.sleep(args.batch_wait)
            state.batch += 1
            state.commit()
        state.epoch += 1
        state.batch = 0
        state.commit()


state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)
# A graph traced in one membership may hold the old size: trace it again.
state.register_reset_callbacks([lambda: holder.update(step=make_step())])
train(state)
note("done", rank=hvd.rank(), size=hvd.size())
