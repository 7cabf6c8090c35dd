"""Elastic training from both faces in one elastic cluster, run by
tests/test_elastic.py under `bpslaunch -np 3 --min-np 2 --max-np 3` with a
discovery script that always offers 3 slots.

Phase A, a Horovod elastic Keras script with one import changed (import
bps_tf.keras as hvd): KerasState, the three Keras callbacks, hvd.elastic.run.
Phase B, an unchanged model.fit under BytePSStrategy(elastic=True).
Each phase, with deterministic data:
- epoch 0 with 3 workers, committed when epoch 1 begins (state.epoch = 1);
- one worker SIGKILLs itself at epoch 1, batch 3 (phase A: the one started
  third; phase B: the newcomer of phase A); bpslaunch tells the scheduler
  at once and starts a replacement, which it announces;
- the two others roll back to the commit, restart their membership and
  train on with 2 workers; they hear of the replacement when that
  membership starts, and at their next commit (epoch 2's start) every
  worker restarts and waits for it; it joins there, receives the committed
  state through sync(), and 3 workers train to epoch EPOCHS. Phase B's
  elastic fit admits the replacement (announced by bpslaunch when it saw
  the SIGKILL) at the first commit after the rollback, epoch 1's again.
The newcomer of phase B skips phase A.

Saved, per phase ("a_", "b_"): each commit rank 0 takes
(commit_e{epoch}_n{size}; phase B when each epoch begins, after its
commit, and when an epoch ends, as the next one's commit), what each worker
starts from, the final variables and what fit
reported. With REF=1 the script instead runs a fixed 2-worker reference of
each phase from REF_A_FROM / REF_B_FROM (epoch 1) to REF_A_UNTIL /
REF_B_UNTIL, saving a_ref / b_ref.
"""
import faulthandler
import json
import os
import signal
import sys
import time

import numpy as np

import bps_tf
import bps_tf.keras as hvd
import keras

faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)  # where a stuck worker was
OUT = sys.argv[1]
EPOCHS = 5
LOST_AT = (1, 3)      # epoch, batch
REF = os.environ.get("REF") == "1"
NEWCOMER = os.environ.get("BYTEPS_ELASTIC_NEWCOMER") == "1"
LAUNCH_INDEX = int(os.environ.get("DMLC_WORKER_ID", "0"))   # of the 3 started first
rng = np.random.default_rng(0)
X = rng.normal(size=(240, 8)).astype("float32")
Y = (X @ rng.normal(size=(8, 1)) + 0.1).astype("float32")


def _path(name):
    return os.path.join(OUT, name)


def _save(name, variables):
    np.savez(_path(name + ".npz"), *[np.asarray(v) for v in variables])


def _note(name, **data):
    with open(_path(name + ".json"), "w") as f:
        json.dump(dict(data, time=time.time()), f)


# The newcomer of phase B starts once phase A is over on every worker.
NEWCOMER_B = NEWCOMER and os.path.exists(_path("a_done_r0.json"))


def _model(prefix):
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((8,)),
                             keras.layers.Dense(16, activation="tanh", name=prefix + "hidden"),
                             keras.layers.Dense(1, name=prefix + "out")], name=prefix + "model")


def _kill_myself(phase):
    _note(phase + "killed")
    os.kill(os.getpid(), signal.SIGKILL)


def _refusals(model):
    """What elastic training refuses, each before anything is sent."""
    import tensorflow as tf
    from bps_tf.overlap import OverlappedApply
    found = {}
    tries = {
        "strategy": lambda: bps_tf.BytePSStrategy(),
        "strategy_overlap": lambda: bps_tf.BytePSStrategy(elastic=True, overlap=True),
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
    _note("refusals", **found)


# ------------------------------------------------------------- phase A

def phase_a():
    hvd.init()
    model = _model("a_")
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01, name="adam_a"))
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)    # the slots exist before the first commit
    if not REF and not NEWCOMER and hvd.rank() == 0:
        _refusals(model)

    class SavingState(hvd.elastic.KerasState):
        def save(self):
            super().save()
            if hvd.rank() == 0 and not REF:
                _save(f"a_commit_e{self.epoch}_n{hvd.size()}", self._values)

    state = SavingState(model, batch=0, epoch=0)
    state.register_reset_callbacks([lambda: _note(
        f"a_reset_e{state.epoch}_n{hvd.size()}_r{hvd.rank()}")])

    class Plan(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if (not NEWCOMER and not REF and LAUNCH_INDEX == 2 and hvd.size() == 3 and
                    (state.epoch, batch) == LOST_AT):
                _kill_myself("a_")

    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=1000),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state), Plan()]

    @hvd.elastic.run
    def train(state):
        _save(f"a_start_e{state.epoch}_n{hvd.size()}_r{hvd.rank()}", state.variables)
        x, y = X[hvd.rank()::hvd.size()], Y[hvd.rank()::hvd.size()]
        steps = len(x) // 8
        model.fit(x[:steps * 8], y[:steps * 8], batch_size=8, shuffle=False,
                  initial_epoch=state.epoch, epochs=int(os.environ.get("REF_A_UNTIL", EPOCHS)),
                  callbacks=callbacks, verbose=0)

    if REF:
        with np.load(os.environ["REF_A_FROM"]) as f:
            values = [f[f"arr_{i}"] for i in range(len(f.files))]
        for var, value in zip(state.variables, values):
            var.assign(value)
        state.epoch = 1
        state.save()
        train(state)
        _save("a_ref", state.variables)
        return
    train(state)
    _save(f"a_final_r{hvd.rank()}", state.variables)
    _note(f"a_done_r{hvd.rank()}", size=hvd.size(), epoch=state.epoch)


# ------------------------------------------------------------- phase B

def phase_b():
    strategy = bps_tf.BytePSStrategy(elastic=not REF, **({"overlap": False} if REF else {}))
    with strategy.scope():
        model = _model("b_")
        model.compile(optimizer=keras.optimizers.Adam(0.01, name="adam_b"), loss="mse")
        model.optimizer.build(model.trainable_variables)

    def variables():
        return list(model.variables) + [v for v in model.optimizer.variables
                                        if not any(v is m for m in model.variables)]

    class Plan(keras.callbacks.Callback):
        epoch = 0

        def on_train_begin(self, logs=None):
            if REF:
                return
            if NEWCOMER_B:
                _save("b_newcomer_start", variables())

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            if not REF and strategy.rank == 0:   # the elastic commit of this epoch ran first
                _save(f"b_commit_e{epoch}_n{strategy.num_workers}", variables())
                _note(f"b_epoch_e{epoch}_n{strategy.num_workers}")

        def on_epoch_end(self, epoch, logs=None):
            # What the next epoch's commit holds: a commit that admits a
            # newcomer leaves fit before any epoch-begin callback runs.
            if not REF and strategy.rank == 0:
                _save(f"b_commit_e{epoch + 1}_n{strategy.num_workers}", variables())

        def on_train_batch_end(self, batch, logs=None):
            if (not REF and NEWCOMER and not NEWCOMER_B and strategy.num_workers == 3 and
                    (self.epoch, batch) == LOST_AT):   # phase A's newcomer
                _kill_myself("b_")

    if REF:
        with np.load(os.environ["REF_B_FROM"]) as f:
            values = [f[f"arr_{i}"] for i in range(len(f.files))]
        for var, value in zip(variables(), values):
            var.assign(value)
        model.fit(X, Y, batch_size=24, shuffle=False, initial_epoch=1,
                  epochs=int(os.environ["REF_B_UNTIL"]), callbacks=[Plan()], verbose=0)
        _save("b_ref", variables())
        return
    # batch_size is fit's global batch under tf.distribute: 8 or 12 per worker.
    history = model.fit(X, Y, batch_size=24, shuffle=False, epochs=EPOCHS, callbacks=[Plan()],
                        verbose=0)
    _save(f"b_final_r{strategy.rank}", variables())
    _note(f"b_done_r{strategy.rank}", size=strategy.num_workers, epochs=history.epoch)


if not NEWCOMER_B:
    phase_a()
phase_b()
