"""An unchanged model.fit under BytePSStrategy(elastic=True) while its
servers, its scheduler and a worker go, run by tests/test_elastic_spof_fit.py
under `bpslaunch -np 2 --servers 2 --min-np 1 --max-np 2` with a discovery
script the job itself controls (OUT/hosts).

Rank 0 does the damage, each once, from its callbacks:
- epoch 1, batch 3: SIGKILL of server 1 (bpslaunch replaces it; the
  replacement joins at the next commit);
- epoch 3, batch 3: SIGKILL of the scheduler (bpslaunch starts it again at
  its address; the nodes re-register);
- epoch 4, batch 2: SIGTERM to worker 1 (it leaves at the next commit), and
  the discovery script offers one slot from then on (no replacement).
Every epoch begins with fit's elastic commit; rank 0 saves the variables
there (OUT/e_commit_e<k>.npz), and every worker logs each attempt of each
epoch (its batches and the worker count).

With REF=1 (a fixed 2-worker job) the script trains the same model
uninterrupted, saving OUT/r_commit_e<k>.npz, and rank 0 then trains one
process on the global batch: from the start (OUT/one_e<k>.npz) and epoch 5
from r_commit_e5 (OUT/one_from_e5.npz).
"""
import faulthandler
import json
import os
import signal
import sys
import time

import numpy as np

import bps_tf
import keras
from bps_tf.runtime import elastic_core

faulthandler.register(signal.SIGUSR1, all_threads=True)   # where a stuck worker is
OUT = sys.argv[1]
REF = os.environ.get("REF") == "1"
PLAN = os.environ.get("SPOF_PLAN", "server,scheduler,worker").split(",")   # what is done
EPOCHS = 6
GLOBAL_BATCH = 24
rng = np.random.default_rng(0)
X = rng.normal(size=(240, 8)).astype("float32")
Y = (X @ rng.normal(size=(8, 1)) + 0.1).astype("float32")


def _path(name):
    return os.path.join(OUT, name)


def _save(name, values):
    np.savez(_path(name + ".npz"), *[np.asarray(v) for v in values])


def _note(name, **data):
    with open(_path(name + ".json"), "w") as f:
        json.dump(dict(data, time=time.time()), f)


def _once(name):
    """True the first time only, whatever rollbacks repeat the call."""
    try:
        os.close(os.open(_path(name + ".once"), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def _job_pid(launch_id):
    """The pid of this job's process that bpslaunch named `launch_id`."""
    token = os.environ["BYTEPS_JOB_TOKEN"].encode()
    want = b"BYTEPS_LAUNCH_ID=" + launch_id.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if want in env and b"BYTEPS_JOB_TOKEN=" + token in env:
            return int(entry)
    raise RuntimeError(f"no process {launch_id!r} in this job")


def _model():
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(1)])


def _variables(model):
    return list(model.variables) + [v for v in model.optimizer.variables
                                    if not any(v is m for m in model.variables)]


strategy = bps_tf.BytePSStrategy(elastic=not REF, **({"overlap": False} if REF else {}))
with strategy.scope():
    model = _model()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.optimizer.build(model.trainable_variables)


class Plan(keras.callbacks.Callback):
    """Saves each epoch's commit, logs every attempt, and (rank 0) does the damage."""

    def __init__(self):
        super().__init__()
        self.attempts = []      # [epoch, batches trained, workers]
        self.killed = {}        # what -> time of the kill
        self.restarted = set()  # kills whose rollback came (an epoch began again since)
        self.back = {}          # what -> time of the first batch after its rollback
        self.updates_before = 0  # the scheduler's host updates before the SIGTERM

    def on_epoch_begin(self, epoch, logs=None):
        self.attempts.append([epoch, 0, strategy.num_workers])
        self.restarted.update(self.killed)
        if strategy.rank == 0:
            _save(("r" if REF else "e") + f"_commit_e{epoch}", _variables(model))

    def on_train_batch_end(self, batch, logs=None):
        self.attempts[-1][1] += 1
        now = time.time()
        for what in self.restarted:
            self.back.setdefault(what, now)
        if REF or strategy.rank != 0:
            return
        epoch = self.attempts[-1][0]
        if (epoch, batch) == (1, 3) and "server" in PLAN and _once("kill_server"):
            self._kill("server", "server 1", signal.SIGKILL)
        elif (epoch, batch) == (3, 3) and "scheduler" in PLAN and _once("kill_scheduler"):
            self._kill("scheduler", "scheduler", signal.SIGKILL)
        elif (epoch, batch) == (4, 2) and "worker" in PLAN and _once("term_worker"):
            # No replacement for the worker that leaves. Written aside and
            # renamed: bpslaunch reads the file every 0.5 s, and an empty one
            # (truncated, not yet written) says no host at all is left.
            with open(_path("hosts.tmp"), "w") as f:
                f.write("localhost:1\n")
            os.replace(_path("hosts.tmp"), _path("hosts"))
            self.updates_before = len(elastic_core.host_updates())
            self._kill("worker", "1", signal.SIGTERM)

    def on_epoch_end(self, epoch, logs=None):
        if REF or strategy.rank != 0 or epoch != 4 or "worker" not in PLAN:
            return
        # Worker 1's SIGTERM handler runs between its steps (Python's signal
        # handlers run in the main thread): by this epoch's end it asked to
        # leave. Rank 0 waits for the scheduler's word of it, so the leave
        # lands at the next commit whatever the machine's speed.
        # (An update of this membership may already be there: the scheduler's
        # restart is one; wait for one more than before the SIGTERM.)
        deadline = time.time() + 120
        while (len(elastic_core.host_updates()) <= self.updates_before
               and time.time() < deadline):
            time.sleep(0.02)

    def _kill(self, what, launch_id, signum):
        pid = _job_pid(launch_id)
        if signum == signal.SIGKILL:
            self.killed[what] = time.time()     # the recovery time: until training again
        os.kill(pid, signum)
        if signum != signal.SIGKILL:
            return
        # Rank 0 holds the others at its next step until the job has taken
        # notice, so the damage lands in this epoch whatever the machine's
        # speed (without it the workers would train on with the servers,
        # and roll back to a later commit).
        deadline = time.time() + 120
        while not elastic_core.changed() and time.time() < deadline:
            time.sleep(0.02)

    def on_train_end(self, logs=None):
        if not REF or strategy.rank != 0:
            return
        _save(f"r_commit_e{EPOCHS - 1}", _variables(model))


plan = Plan()
if REF:
    model.fit(X, Y, batch_size=GLOBAL_BATCH, shuffle=False, epochs=EPOCHS - 1, callbacks=[plan],
              verbose=0)
    if strategy.rank == 0:
        # One process on the global batch, outside the strategy.
        one = _model()
        one.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        one.optimizer.build(one.trainable_variables)
        for epoch in range(EPOCHS):
            _save(f"one_e{epoch}", _variables(one))
            one.fit(X, Y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
        _save(f"one_e{EPOCHS}", _variables(one))
        with np.load(_path(f"r_commit_e{EPOCHS - 1}.npz")) as f:
            values = [f[f"arr_{i}"] for i in range(len(f.files))]
        for var, value in zip(_variables(one), values):
            var.assign(value)
        one.fit(X, Y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
        _save(f"one_from_e{EPOCHS - 1}", _variables(one))
    sys.exit(0)

history = model.fit(X, Y, batch_size=GLOBAL_BATCH, shuffle=False, epochs=EPOCHS,
                    callbacks=[plan], verbose=0)
_save(f"e_final_r{strategy.rank}", _variables(model))
_note(f"e_done_r{strategy.rank}", epochs=history.epoch, attempts=plan.attempts,
      size=strategy.num_workers,
      recovery={k: plan.back[k] - t for k, t in plan.killed.items() if k in plan.back})
