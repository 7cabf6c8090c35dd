"""A Horovod elastic Keras script with one import changed (import bps_tf.keras
as hvd), run by tests/test_elastic.py under an elastic bpslaunch.

Deterministic data and a plan the script drives itself, so the test can
compare exact weights:
- epoch 0 with 3 workers, committed at its end (state.epoch = 1);
- the worker started third SIGKILLs itself at epoch 1, batch 3 (mid-epoch);
  the discovery script still offers its slot, so bpslaunch starts a
  newcomer at once, which imports TensorFlow and waits to ask to join;
- the two others roll back to the commit, restart their membership and
  train epochs 1-2 with 2 workers;
- with 2 workers rank 0 lets the newcomer ask: it joins at the next commit
  it is there for (HostsUpdatedInterrupt), at the latest at epoch 3's,
  where the workers keep committing until it comes; it gets the committed
  state through sync(), and 3 workers train to epoch 5.

Every commit rank 0 takes is saved (commit_e{epoch}_n{size}.npz); each
worker saves its variables when func starts (start_e{epoch}_n{size}_r{rank})
and at the end (final_r{rank}). With REF_FROM (a commit file) and REF_UNTIL,
the script instead resumes a fixed-size run from that commit and saves its
variables at epoch REF_UNTIL (ref.npz).
"""
import json
import os
import signal
import sys
import time

import numpy as np

import bps_tf.keras as hvd
import keras

OUT = sys.argv[1]
EPOCHS = 5
BATCH = 8
LOST_AT = (1, 3)      # epoch, batch
JOIN_AT = 3           # the last epoch whose commit may admit the newcomer
REF_FROM = os.environ.get("REF_FROM", "")
REF_UNTIL = int(os.environ.get("REF_UNTIL", "0"))
NEWCOMER = os.environ.get("BYTEPS_ELASTIC_NEWCOMER") == "1"
LAUNCH_INDEX = int(os.environ.get("DMLC_WORKER_ID", "0"))

if NEWCOMER:
    # The launcher replaces the lost worker at once; it imports TensorFlow now
    # and asks to join once the two others have a 2-worker epoch to show.
    deadline = time.time() + 120
    while not os.path.exists(os.path.join(OUT, "newcomer_go")) and time.time() < deadline:
        time.sleep(0.1)
hvd.init()
keras.utils.set_random_seed(7)
rng = np.random.default_rng(0)
X = rng.normal(size=(240, 8)).astype("float32")
Y = (X @ rng.normal(size=(8, 1)) + 0.1).astype("float32")

model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                          keras.layers.Dense(1)])
opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
model.compile(optimizer=opt, loss="mse")
opt.build(model.trainable_variables)    # the slots exist before the first commit


def _refusals():
    """What elastic training refuses, each before anything is sent."""
    import tensorflow as tf
    import bps_tf
    from bps_tf.overlap import OverlappedApply
    found = {}
    tries = {
        "strategy": lambda: bps_tf.BytePSStrategy(),          # without elastic=True
        "compression": lambda: hvd.allreduce(
            tf.ones([4096]), compression=hvd.Compression.topk(0.1, error_feedback=True)),
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


if not REF_FROM and not NEWCOMER and hvd.rank() == 0:
    _refusals()


def _save(name, values):
    np.savez(os.path.join(OUT, name + ".npz"), *values)


class SavingState(hvd.elastic.KerasState):
    def save(self):
        super().save()
        if hvd.rank() == 0 and not REF_FROM:
            _save(f"commit_e{self.epoch}_n{hvd.size()}", self._values)


state = SavingState(model, batch=0, epoch=0)


def on_reset():
    with open(os.path.join(OUT, f"reset_e{state.epoch}_n{hvd.size()}_r{hvd.rank()}.json"),
              "w") as f:
        json.dump({"time": time.time(), "rank": hvd.rank(), "size": hvd.size()}, f)


state.register_reset_callbacks([on_reset])


class Plan(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if (not NEWCOMER and not REF_FROM and LAUNCH_INDEX == 2 and hvd.size() == 3 and
                (state.epoch, batch) == LOST_AT):
            with open(os.path.join(OUT, "killed.json"), "w") as f:
                json.dump({"time": time.time()}, f)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_begin(self, epoch, logs=None):
        # After CommitStateCallback's commit: wait, committing, for the newcomer.
        if REF_FROM or hvd.size() != 2 or state.epoch != JOIN_AT:
            return
        deadline = time.time() + 120
        while time.time() < deadline:
            state.commit()     # raises HostsUpdatedInterrupt on every worker at once
            time.sleep(0.2)
        raise RuntimeError("no newcomer came within 120 s")


callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=1000),
             hvd.elastic.UpdateBatchStateCallback(state),
             hvd.elastic.UpdateEpochStateCallback(state),
             Plan()]


@hvd.elastic.run
def train(state):
    if not REF_FROM and hvd.size() == 2 and hvd.rank() == 0:
        with open(os.path.join(OUT, "newcomer_go"), "w"):   # it joins at the next commit
            pass
    _save(f"start_e{state.epoch}_n{hvd.size()}_r{hvd.rank()}",
          [v.numpy() for v in state.variables])
    x, y = X[hvd.rank()::hvd.size()], Y[hvd.rank()::hvd.size()]
    steps = len(x) // BATCH
    model.fit(x[:steps * BATCH], y[:steps * BATCH], batch_size=BATCH, shuffle=False,
              initial_epoch=state.epoch, epochs=REF_UNTIL or EPOCHS, callbacks=callbacks,
              verbose=0)


if REF_FROM:
    with np.load(REF_FROM) as f:
        values = [f[f"arr_{i}"] for i in range(len(f.files))]
    for var, value in zip(state.variables, values):
        var.assign(value)
    state.epoch = int(os.environ["REF_EPOCH"])
    state.save()
    train(state)
    _save("ref", [v.numpy() for v in state.variables])
else:
    train(state)
    _save(f"final_r{hvd.rank()}", [v.numpy() for v in state.variables])
    with open(os.path.join(OUT, f"done_r{hvd.rank()}.json"), "w") as f:
        json.dump({"size": hvd.size(), "epoch": state.epoch}, f)
