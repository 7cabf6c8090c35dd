"""Worker script for test_strategy.py: BackupAndRestore across a crash.

    bpslaunch -np 2 --servers 1 python tests/workers/strategy_backup.py OUT BACKUP crash
    bpslaunch -np 2 --servers 1 python tests/workers/strategy_backup.py OUT BACKUP resume

``crash``: trains for EPOCHS epochs with keras.callbacks.BackupAndRestore
(saved at every epoch end); rank 1 kills itself (SIGKILL) in the middle
of the second epoch, so the job fails after the first epoch's backup.
``resume``: the same script again; it must start at the second epoch from
the backup and finish.
``straight``: the same training without a crash, for comparison.

Each rank writes OUT/<mode>.rank<r>.json: the epochs it began, and (resume)
a digest of its weights right after the restore and at the end;
rank 0 of the crash run also records its weights at the first epoch's end
(what the backup holds).
"""
import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import keras  # noqa: E402

import bps_tf  # noqa: E402
from bps_tf.strategy import BytePSStrategy  # noqa: E402

EPOCHS = 4
CRASH_EPOCH, CRASH_BATCH = 1, 2      # 0-based: the second epoch's third batch


def digest(model):
    return [float(np.sum(np.asarray(w, np.float64))) for w in model.get_weights()]


class Record(keras.callbacks.Callback):
    def __init__(self, mode, rank, out_dir):
        super().__init__()
        self.mode, self.rank = mode, rank
        self.path = os.path.join(out_dir, f"{mode}.rank{rank}.json")
        self.report = {"epochs": [], "rank": rank}
        self.epoch = None

    def write(self):
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.report, f)
        os.replace(self.path + ".tmp", self.path)

    def on_train_begin(self, logs=None):
        # BackupAndRestore comes first in the callback list: this sees the
        # restored weights.
        self.report["after_restore"] = digest(self.model)
        self.write()

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.report["epochs"].append(epoch)
        self.write()

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.report["after_first_epoch"] = digest(self.model)
            self.write()

    def on_train_batch_begin(self, batch, logs=None):
        if (self.mode == "crash" and self.rank == 1 and self.epoch == CRASH_EPOCH
                and batch == CRASH_BATCH):
            self.report["crashed_at"] = [self.epoch, batch]
            self.write()
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_end(self, logs=None):
        self.report["final"] = digest(self.model)
        self.write()


def main(out_dir, backup_dir, mode):
    keras.utils.set_random_seed(0)
    strategy = BytePSStrategy()
    rank = bps_tf.rank()
    rng = np.random.RandomState(7)
    x = rng.randn(96, 6).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    record = Record(mode, rank, out_dir)
    model.fit(x, y, batch_size=16, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(backup_dir), record])
    record.report["done"] = True
    record.write()


if __name__ == "__main__":
    main(*sys.argv[1:4])
