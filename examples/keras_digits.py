"""Keras model.fit, unchanged, across workers with BytePSStrategy (handwriting-like digits).

    bpslaunch -np 2 --servers 1 python examples/keras_digits.py
    bpslaunch -np 2 --servers 1 python examples/keras_digits.py --mode async --batch-size 32
    bpslaunch -np 2 --min-np 1 --max-np 3 python examples/keras_digits.py   # elastic
    python examples/keras_digits.py                # one process, no cluster

The script is an ordinary Keras script: build and compile under
``strategy.scope()``, then ``fit`` / ``evaluate``. ``batch_size`` is the
global batch; each worker trains on its shard of every batch and the
gradients are summed through the servers, so every worker holds the same
weights. ``evaluate`` returns the metrics of the whole test set on every
worker; rank 0 prints them. The data is drawn by examples/digits_data.py (nothing is
downloaded).

In an elastic job (``BYTEPS_ELASTIC=1``, e.g. examples/k8s/indexed-job-elastic.yaml)
the strategy is ``BytePSStrategy(elastic=True)``: workers may come and go while
``fit`` runs (docs/elastic.md).

``--mode async``: asynchronous parameter-server training (docs/strategy.md):
each worker trains on its rows with its own batch (``--batch-size`` is then
per worker), pushes its weight changes and pulls the servers' weights,
without waiting for the others; ``evaluate`` runs on each worker alone.
"""
import argparse
import os

import numpy as np
import keras

import bps_tf

from digits_data import load_digits   # this folder: the data, drawn at start


def load_data():
    images, labels = load_digits()
    x = (images / 16.0).astype("float32")
    y = labels
    order = np.random.RandomState(0).permutation(len(x))   # the same on every worker
    x, y = x[order], y[order]
    split = len(x) * 4 // 5
    return (x[:split], y[:split]), (x[split:], y[split:])


def build_model():
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dropout(0.1),
        keras.layers.Dense(10),
    ])


def elastic_job():
    """Whether this process is part of an elastic job (BYTEPS_ELASTIC=1 on every node)."""
    return os.environ.get("BYTEPS_ELASTIC", "0").strip().lower() in ("1", "true", "yes", "on")


def main(argv=None, callbacks=()):
    """Trains and evaluates; returns fit's History. ``callbacks`` go to fit."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--mode", choices=("sync", "async"), default=None,
                        help="default: async if BYTEPS_ENABLE_ASYNC=1, else sync")
    args = parser.parse_args(argv)

    # Joins the cluster that bpslaunch (TF_CONFIG, a Kubernetes pod) describes;
    # alone without one.
    strategy = bps_tf.BytePSStrategy(mode=args.mode, elastic=elastic_job())
    rank = bps_tf.rank()
    # The same seed on every worker: the epochs' shuffles agree, so the
    # workers' shards split each global batch between them.
    keras.utils.set_random_seed(0)

    (x_train, y_train), (x_test, y_test) = load_data()
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=keras.optimizers.Adam(args.lr),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])

    history = model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
                        callbacks=list(callbacks), verbose=2 if rank == 0 else 0)
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
    if bps_tf.rank() == 0:    # elastic: the rank at the end (a survivor is rank 0)
        workers, replicas = strategy.num_workers, strategy.num_replicas_in_sync
        print(f"test accuracy: {accuracy:.4f}, loss {loss:.4f} "
              f"({workers} worker{'s' if workers > 1 else ''}, "
              f"{replicas} replica{'s' if replicas > 1 else ''})", flush=True)
    return history


if __name__ == "__main__":
    main()
