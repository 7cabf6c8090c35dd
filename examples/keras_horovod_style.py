"""A Horovod Keras script, run by bps_tf with one line changed: the import.

    bpslaunch -np 2 --servers 1 python examples/keras_horovod_style.py     # Keras 3
    TF_USE_LEGACY_KERAS=1 bpslaunch -np 2 --servers 1 python examples/keras_horovod_style.py

The second line runs it on Keras 2 (tf.keras is tf_keras when
TF_USE_LEGACY_KERAS=1; `pip install tf_keras` matching your TensorFlow).
Written the way Horovod's Keras examples are:
scale the learning rate by the number of workers, wrap the optimizer,
broadcast rank 0's weights, average the metrics, warm the learning rate up,
let rank 0 alone checkpoint and print. Each worker trains on its own shard
of the digits drawn by examples/digits_data.py (nothing is downloaded).
"""
import argparse
import os
import tempfile

import numpy as np
import tensorflow as tf

import bps_tf.keras as hvd   # was: import horovod.tensorflow.keras as hvd

from digits_data import load_digits   # this folder: the data, drawn at start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1234, help="weights and shuffles")
    args = parser.parse_args()

    hvd.init()
    tf.keras.utils.set_random_seed(args.seed)

    images, labels = load_digits()
    x = (images / 16.0).astype("float32")
    y = labels
    order = np.random.RandomState(0).permutation(len(x))
    x, y = x[order], y[order]
    split = len(x) * 4 // 5
    x_train, y_train = x[:split][hvd.rank()::hvd.size()], y[:split][hvd.rank()::hvd.size()]
    x_test, y_test = x[split:], y[split:]

    model = tf.keras.Sequential([
        tf.keras.Input((64,)),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])
    scaled_lr = 0.01 * hvd.size()
    opt = tf.keras.optimizers.Adam(scaled_lr)
    opt = hvd.DistributedOptimizer(opt)
    model.compile(loss="sparse_categorical_crossentropy", optimizer=opt,
                  metrics=["accuracy"])

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=1,
                                                 verbose=1),
    ]
    if hvd.rank() == 0:
        suffix = "h5" if tf.keras.__name__.startswith("tf_keras") else "keras"
        checkpoints = os.path.join(tempfile.mkdtemp(), "checkpoint-{epoch}." + suffix)
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(checkpoints))

    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
              callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    accuracy = float(hvd.allreduce(accuracy, name="test_accuracy"))
    if hvd.rank() == 0:
        print(f"final accuracy {accuracy:.4f}")


if __name__ == "__main__":
    main()
