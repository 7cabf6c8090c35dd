"""Data-parallel training with DistributedGradientTape on handwriting-like digits.

    bpslaunch -np 2 --servers 1 python examples/tf2_digits_tape.py
    python examples/tf2_digits_tape.py            # one process, size 1

Each worker trains on its own shard (rows rank::size) of the training set;
the gradients are averaged across workers, so every worker holds the same
weights. Rank 0 prints the test accuracy. The data is drawn by
examples/digits_data.py (nothing is downloaded).
"""
import argparse

import numpy as np
import tensorflow as tf
import keras

import bps_tf as bps

from digits_data import load_digits   # this folder: the data, drawn at start


def load_data():
    images, labels = load_digits()
    x = (images / 16.0).astype("float32")
    y = labels
    order = np.random.RandomState(0).permutation(len(x))   # same on every worker
    x, y = x[order], y[order]
    split = len(x) * 4 // 5
    return (x[:split], y[:split]), (x[split:], y[split:])


def build_model():
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=2e-3, help="for one worker")
    args = parser.parse_args()

    bps.init()
    rank, size = bps.rank(), bps.size()
    (x_train, y_train), (x_test, y_test) = load_data()
    x_shard, y_shard = x_train[rank::size], y_train[rank::size]
    # Every worker must run the same number of steps (each step is a
    # collective): count them on the smallest shard.
    steps_per_epoch = (len(x_train) // size) // args.batch_size

    model = build_model()
    # Larger effective batch -> scale the rate with the number of workers.
    optimizer = keras.optimizers.Adam(args.lr * size)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    # Start every worker from rank 0's weights (and optimizer state).
    bps.broadcast_variables(model.variables + optimizer.variables, root_rank=0)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = bps.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    dataset = (tf.data.Dataset.from_tensor_slices((x_shard, y_shard))
               .shuffle(len(x_shard), seed=rank, reshuffle_each_iteration=True)
               .batch(args.batch_size, drop_remainder=True)
               .take(steps_per_epoch))
    for epoch in range(args.epochs):
        losses = [float(train_step(x, y)) for x, y in dataset]
        if rank == 0 and (epoch + 1) % 5 == 0:
            print(f"epoch {epoch + 1}: loss {np.mean(losses):.4f}", flush=True)

    logits = model(x_test, training=False)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
    if rank == 0:
        print(f"test accuracy: {accuracy:.4f} ({size} worker{'s' if size > 1 else ''})",
              flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
