"""An unchanged model.fit under BytePSStrategy(elastic=True), run by
tests/test_elastic.py under an elastic bpslaunch, with the plan of
elastic_keras.py: epoch 0 with 3 workers; the worker started third SIGKILLs
itself at epoch 1, batch 3; epochs 1.. with 2 workers, from the commit of
epoch 1's start; the newcomer bpslaunch started in its place asks to join
once rank 0 lets it and joins at an epoch's commit (at the latest epoch 3's,
where the two wait for it); 3 workers to epoch 5.

Saved: the state at each epoch's start as committed (commit_e{epoch}_n{size},
rank 0), the final variables (final_r{rank}), the newcomer's variables
when its fit begins (newcomer_start). With REF_FROM/REF_EPOCH/REF_UNTIL: a
fixed-size run (BYTEPS_ELASTIC unset, overlap off) from that commit, saving
ref.npz at epoch REF_UNTIL.
"""
import json
import os
import signal
import sys
import time

import numpy as np

import bps_tf
import keras

import faulthandler
faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)  # where a stuck worker was

OUT = sys.argv[1]
EPOCHS = 5
BATCH = 24            # the global batch under tf.distribute: 8 or 12 per worker
LOST_AT = (1, 3)
JOIN_AT = 3
REF_FROM = os.environ.get("REF_FROM", "")
REF_UNTIL = int(os.environ.get("REF_UNTIL", "0"))
NEWCOMER = os.environ.get("BYTEPS_ELASTIC_NEWCOMER") == "1"
LAUNCH_INDEX = int(os.environ.get("DMLC_WORKER_ID", "0"))

if NEWCOMER:   # as in elastic_keras.py: TensorFlow imported, waits to ask to join
    deadline = time.time() + 120
    while not os.path.exists(os.path.join(OUT, "newcomer_go")) and time.time() < deadline:
        time.sleep(0.1)
strategy = bps_tf.BytePSStrategy(elastic=not REF_FROM, **({"overlap": False} if REF_FROM else {}))
keras.utils.set_random_seed(7)
rng = np.random.default_rng(0)
X = rng.normal(size=(240, 8)).astype("float32")
Y = (X @ rng.normal(size=(8, 1)) + 0.1).astype("float32")
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.optimizer.build(model.trainable_variables)


def _refusals():
    """What elastic training refuses, each before anything is sent."""
    import tensorflow as tf
    from bps_tf.overlap import OverlappedApply
    found = {}
    tries = {
        "strategy": lambda: bps_tf.BytePSStrategy(elastic=True, overlap=True),
        "compression": lambda: bps_tf.allreduce(
            tf.ones([4096]), compression=bps_tf.Compression.topk(0.1, error_feedback=True)),
        "overlap": lambda: OverlappedApply(model, keras.optimizers.SGD(0.1)),
    }
    for name, attempt in tries.items():
        try:
            attempt()
            found[name] = "accepted"
        except (NotImplementedError, ValueError) as exc:
            found[name] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(OUT, "refusals.json"), "w") as f:
        json.dump(found, f)


if not REF_FROM and not NEWCOMER and strategy.rank == 0:
    _refusals()


def _variables():
    return list(model.variables) + [v for v in model.optimizer.variables
                                    if not any(v is m for m in model.variables)]


def _save(name):
    np.savez(os.path.join(OUT, name + ".npz"), *[v.numpy() for v in _variables()])


class Plan(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epoch = 0

    def on_train_begin(self, logs=None):
        if REF_FROM:
            return
        if NEWCOMER:
            _save("newcomer_start")
        if strategy.num_workers == 2 and strategy.rank == 0:
            with open(os.path.join(OUT, "newcomer_go"), "w"):
                pass

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        if REF_FROM:
            return
        if strategy.rank == 0:     # the elastic commit of this epoch's start ran first
            _save(f"commit_e{epoch}_n{strategy.num_workers}")
            with open(os.path.join(OUT, f"epoch_e{epoch}_n{strategy.num_workers}.json"),
                      "w") as f:
                json.dump({"time": time.time()}, f)
        if strategy.num_workers == 2 and epoch == JOIN_AT:
            deadline = time.time() + 120
            while time.time() < deadline:   # leaves with HostsUpdatedInterrupt on every worker
                bps_tf.elastic.ObjectState().check_host_updates()
                time.sleep(0.2)
            raise RuntimeError("no newcomer came within 120 s")

    def on_train_batch_end(self, batch, logs=None):
        if (not NEWCOMER and not REF_FROM and LAUNCH_INDEX == 2 and
                strategy.num_workers == 3 and (self.epoch, batch) == LOST_AT):
            with open(os.path.join(OUT, "killed.json"), "w") as f:
                json.dump({"time": time.time()}, f)
            os.kill(os.getpid(), signal.SIGKILL)


if REF_FROM:
    with np.load(REF_FROM) as f:
        values = [f[f"arr_{i}"] for i in range(len(f.files))]
    for var, value in zip(_variables(), values):
        var.assign(value)
    model.fit(X, Y, batch_size=BATCH, shuffle=False, initial_epoch=int(os.environ["REF_EPOCH"]),
              epochs=REF_UNTIL, callbacks=[Plan()], verbose=0)
    _save("ref")
else:
    history = model.fit(X, Y, batch_size=BATCH, shuffle=False, epochs=EPOCHS,
                        callbacks=[Plan()], verbose=0)
    _save(f"final_r{strategy.rank}")
    with open(os.path.join(OUT, f"done_r{strategy.rank}.json"), "w") as f:
        json.dump({"size": strategy.num_workers, "epochs": len(history.epoch)}, f)
