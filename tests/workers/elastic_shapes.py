"""model.fit under BytePSStrategy(elastic=True) in the shapes scripts take,
run by tests/test_elastic_fit.py under `bpslaunch -np 3 --min-np 1
--max-np 3` with a discovery script that lists hosts of one slot each:
127.0.0.1-3 at the start (a failed worker blacklists its host, so nobody
replaces it), and 127.0.0.4-5 once the plan wants its two newcomers (rank 0
adds them to the list; bpslaunch starts a worker on each, and announces
them, so the next commit admits them).

The script (PROGRAM below) is an ordinary Keras script with a global batch
of 20 that 3 workers share unevenly (7, 7, 6):

  call 0  evaluate            worker 2 fails during it: 3 -> 2 workers
  call 1  fit(epochs=1)       a loop of fit(epochs=1)
  call 2  fit(epochs=1)
  call 3  predict             worker 1 fails during it: 2 -> 1
  call 4  fit(epochs=8) with EarlyStopping, ReduceLROnPlateau,
          ModelCheckpoint(save_best_only=True), BackupAndRestore(save_freq=3) and
          two callbacks of the user's that keep state (elastic_state_attributes,
          get/set_elastic_state):
          at epoch 2 the two replacements join (1 -> 3 workers: each starts
          the script from the top and replays calls 0-3); at epoch 4, batch 1,
          worker 0 (rank 0, the checkpoints' writer) is SIGKILLed: 3 -> 2, a
          newcomer becomes rank 0. A synthetic monitored value ("plateau")
          makes the callbacks' decisions independent of float rounding:
          improvements until epoch 2, so EarlyStopping(patience=3) stops after
          epoch 5, ReduceLROnPlateau(patience=1) halves the rate at epochs 3-5
          and the checkpoint holds epoch 2's weights -- unless a change makes
          them forget.
  call 5  evaluate
  call 6  predict

With REF=1 the same program runs in one process with plain Keras (no
strategy): the reference. Saved in OUT (npz/json): every epoch's starting
weights (rank 0 after the elastic commit), and each surviving worker's
results (every call's return value, the final weights, the learning rate,
EarlyStopping's stop, the checkpoint's weights). REF=1 also checks a
BytePSStrategy of one process with 3 local devices on the same uneven batch.
"""
import faulthandler
import json
import os
import signal
import sys
import time

faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)  # where a stuck worker was
OUT = sys.argv[1]
REF = os.environ.get("REF") == "1"
NEWCOMER = os.environ.get("BYTEPS_ELASTIC_NEWCOMER") == "1"
LAUNCH_INDEX = int(os.environ.get("DMLC_WORKER_ID", "0"))
JOINERS = 2          # replacements that join; later ones wait for the end


def _path(name):
    return os.path.join(OUT, name)


def _note(name, **data):
    with open(_path(name + ".json"), "w") as f:
        json.dump(dict(data, time=time.time()), f)


def _wait_for(*names, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for name in names:
            if os.path.exists(_path(name + ".json")):
                return name
        time.sleep(0.1)
    raise RuntimeError(f"none of {names} within {timeout} s")


def _newcomer_number():
    """1, 2, ...: the order in which replacements started."""
    n = 1
    while True:
        try:
            os.close(os.open(_path(f"newcomer_{n}"), os.O_CREAT | os.O_EXCL))
            return n
        except FileExistsError:
            n += 1


if NEWCOMER and not REF and _newcomer_number() > JOINERS:
    _wait_for("done_r0", "done_r1")   # nothing left to join: leave with the job
    sys.exit(0)

if REF:
    import tensorflow as tf
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 3)

import numpy as np  # noqa: E402
import keras  # noqa: E402

import bps_tf  # noqa: E402
from bps_tf.runtime import elastic_core  # noqa: E402
from bps_tf.strategy import predictions  # noqa: E402

BATCH = 20
EPOCHS = 8
PLATEAU = [5.0, 4.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]
rng = np.random.default_rng(0)
X = rng.normal(size=(240, 8)).astype("float32")
Y = (X @ rng.normal(size=(8, 1)) + 0.1).astype("float32")
X_TEST = rng.normal(size=(50, 8)).astype("float32")


def make_model():
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def weights(model):
    return [np.asarray(v) for v in model.weights]


class Plateau(keras.callbacks.Callback):
    """Puts the synthetic monitored value into the epoch's logs."""

    def on_epoch_end(self, epoch, logs=None):
        logs["plateau"] = PLATEAU[epoch]


class Counted(keras.callbacks.Callback):
    """A user's callback whose state the commit keeps: named attributes."""
    elastic_state_attributes = ("batches",)

    def __init__(self):
        super().__init__()
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


class Seen(keras.callbacks.Callback):
    """... or its own get/set methods."""

    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(epoch)

    def get_elastic_state(self):
        return list(self.epochs)

    def set_elastic_state(self, state):
        self.epochs = list(state)


class Plan(keras.callbacks.Callback):
    """What happens to this worker where (nothing in the reference), and
    each epoch's starting weights (rank 0, after the elastic commit)."""

    def __init__(self, call, strategy):
        super().__init__()
        self.call, self.strategy, self.epoch = call, strategy, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        size = 1 if self.strategy is None else self.strategy.num_workers
        if self.strategy is None or self.strategy.rank == 0:
            tag = "ref" if REF else f"n{size}_t{time.time():.6f}"
            np.savez(_path(f"start_c{self.call}_e{epoch}_{tag}.npz"), *weights(self.model))
        if not REF and self.call == 4 and epoch == 2 and size == 1:
            with open(_path("hosts"), "a") as f:     # bpslaunch's discovery reads it
                f.write("127.0.0.4:1\n127.0.0.5:1\n")
            deadline = time.time() + 240
            while time.time() < deadline:
                if elastic_core.workers_waiting() >= JOINERS:
                    bps_tf.elastic.ObjectState().check_host_updates()   # raises: they join
                time.sleep(0.1)
            raise RuntimeError("the replacements did not ask to join within 240 s")

    def on_train_batch_end(self, batch, logs=None):
        if (not REF and not NEWCOMER and LAUNCH_INDEX == 0 and self.call == 4
                and (self.epoch, batch) == (4, 1) and self.strategy.num_workers == 3):
            _note("killed")
            os.kill(os.getpid(), signal.SIGKILL)

    def on_test_batch_end(self, batch, logs=None):
        if not REF and not NEWCOMER and LAUNCH_INDEX == 2 and self.call == 0 and batch == 1:
            raise RuntimeError("planned failure of worker 2 during evaluate")


def _fail_in_predict(call):
    """Worker 1 fails inside predict (after the phase check, before the
    gather: the others wait for its rows)."""
    gather = predictions.gather_predictions

    def failing(*args, **kwargs):
        if not NEWCOMER and LAUNCH_INDEX == 1 and call[0] == 3:
            raise RuntimeError("planned failure of worker 1 during predict")
        return gather(*args, **kwargs)
    predictions.gather_predictions = failing


def program(strategy, backup_dir, checkpoint):
    """The user's script; returns what it saw."""
    call = [0]
    if strategy is None:
        model = make_model()
    else:
        with strategy.scope():
            model = make_model()
        _fail_in_predict(call)
    seen = {}
    seen["evaluate0"] = model.evaluate(X, Y, batch_size=BATCH, verbose=0,
                                       callbacks=[Plan(0, strategy)])
    for i in (1, 2):
        call[0] = i
        history = model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                            callbacks=[Plan(i, strategy)])
        seen[f"fit{i}"] = {"epoch": history.epoch, "loss": history.history["loss"]}
    call[0] = 3
    seen["predict3"] = np.asarray(model.predict(X_TEST, batch_size=16, verbose=0)).tolist()
    call[0] = 4
    stop = keras.callbacks.EarlyStopping(monitor="plateau", mode="min", patience=3)
    counted, epochs_seen = Counted(), Seen()
    history = model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[Plateau(), stop, counted, epochs_seen,
                                   keras.callbacks.ReduceLROnPlateau(monitor="plateau",
                                                                     mode="min", patience=1),
                                   keras.callbacks.ModelCheckpoint(
                                       checkpoint, monitor="plateau", mode="min",
                                       save_best_only=True, save_weights_only=True),
                                   keras.callbacks.BackupAndRestore(backup_dir, save_freq=3),
                                   Plan(4, strategy)])
    seen["fit4"] = {"epoch": history.epoch, "loss": history.history["loss"],
                    "stopped_epoch": stop.stopped_epoch, "batches": counted.batches,
                    "epochs_seen": epochs_seen.epochs,
                    "learning_rate": float(np.asarray(model.optimizer.learning_rate))}
    call[0] = 5
    seen["evaluate5"] = model.evaluate(X, Y, batch_size=BATCH, verbose=0)
    call[0] = 6
    seen["predict6"] = np.asarray(model.predict(X_TEST, batch_size=16, verbose=0)).tolist()
    return model, seen


def _checkpoint_weights(checkpoint):
    model = make_model()
    model.load_weights(checkpoint)
    return weights(model)


def local_replicas():
    """One process, 3 local devices, the same uneven batch (7, 7, 6): each
    epoch's weights against plain Keras."""
    plain = make_model()
    strategy = bps_tf.BytePSStrategy(devices=["/cpu:0", "/cpu:1", "/cpu:2"])
    with strategy.scope():
        model = make_model()
    diffs = []
    for _ in range(3):
        plain.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        diffs.append(max(float(np.abs(a - b).max())
                         for a, b in zip(weights(plain), weights(model))))
    return {"replicas": strategy.num_replicas_in_sync, "diffs": diffs}


def main():
    if REF:
        model, seen = program(None, _path("ref_backup"), _path("ref_ckpt.weights.h5"))
        seen["local_replicas"] = local_replicas()
        rank = "ref"
    else:
        strategy = bps_tf.BytePSStrategy(elastic=True)
        model, seen = program(strategy, _path("backup"), _path("ckpt.weights.h5"))
        rank = f"r{strategy.rank}"
        seen["size"] = strategy.num_workers
    seen["newcomer"] = NEWCOMER
    np.savez(_path(f"final_{rank}.npz"), *weights(model))
    np.savez(_path(f"checkpoint_{rank}.npz"), *_checkpoint_weights(
        _path("ref_ckpt.weights.h5" if REF else "ckpt.weights.h5")))
    with open(_path(f"seen_{rank}.json"), "w") as f:
        json.dump(seen, f)
    _note(f"done_{rank}")


main()
