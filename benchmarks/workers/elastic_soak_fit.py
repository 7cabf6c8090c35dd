"""The training of benchmarks/elastic_soak.py: a small MLP on a synthetic
classification task, `model.fit` with a fixed global batch.

    elastic_soak_fit.py OUT_DIR soak       # a worker of the elastic job (bpslaunch starts it)
    elastic_soak_fit.py OUT_DIR baseline   # one process, plain Keras, uninterrupted

OUT_DIR/spec.json: seed, rows, held_out, features, classes, label_noise,
hidden, batch, lr, max_epochs, and (baseline) epochs.

soak: the model under BytePSStrategy(elastic=True), fit for up to
max_epochs epochs. Each worker logs its progress to
OUT_DIR/progress_<launch id>.jsonl, one JSON line per event: "begin" (an
attempt of an epoch begins: after the elastic commit), "b" (a batch
ended), "end" (the epoch ended), each with the time, the epoch, the
membership epoch ("m") and the worker count ("n"). The soak decides when
training ends: once it writes OUT_DIR/stop.json ({"last_epoch": K}) every
worker stops after epoch K (model.stop_training at that epoch's end, the
same epoch on every worker: K is chosen epochs ahead of the training).
Every worker that finishes writes OUT_DIR/done_<launch id>.json: fit's
History, the accuracy on a held-out set (computed locally with numpy, no
collective), a digest of its weights.

baseline: the same model, data and global batch in one process without
bps_tf, for `epochs` epochs (what every elastic epoch equals: one process
on the global batch, docs/elastic.md); writes OUT_DIR/baseline.json.
"""
import hashlib
import json
import os
import sys
import time

import numpy as np

OUT, MODE = sys.argv[1], sys.argv[2]
with open(os.path.join(OUT, "spec.json")) as f:
    SPEC = json.load(f)


def data(spec):
    """Inputs N(0, 1); labels from a fixed random two-layer tanh teacher
    (`label_noise` of them replaced at random): learnable over tens of
    epochs. The first `rows` rows train, the rest are held out."""
    rng = np.random.default_rng(spec["seed"])
    count, features, classes = spec["rows"] + spec["held_out"], spec["features"], spec["classes"]
    w1 = rng.normal(size=(features, 16)) / np.sqrt(features)
    w2 = rng.normal(size=(16, classes))
    x = rng.normal(size=(count, features)).astype("float32")
    y = np.argmax(np.tanh(x @ w1) @ w2, axis=1)
    flip = rng.random(count) < spec["label_noise"]
    y[flip] = rng.integers(0, classes, size=int(flip.sum()))
    y = y.astype("int64")
    n = spec["rows"]
    return x[:n], y[:n], x[n:], y[n:]


def build(keras, spec):
    keras.utils.set_random_seed(spec["seed"])
    layers = [keras.Input((spec["features"],))]
    layers += [keras.layers.Dense(w, activation="relu") for w in spec["hidden"]]
    layers.append(keras.layers.Dense(spec["classes"]))
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.Adam(spec["lr"]),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def accuracy(weights, x, y):
    """The dense ReLU stack's accuracy, in numpy (no collective, no strategy)."""
    h = x
    pairs = list(zip(weights[0::2], weights[1::2]))
    for i, (w, b) in enumerate(pairs):
        h = h @ w + b
        if i < len(pairs) - 1:
            h = np.maximum(h, 0.0)
    return float(np.mean(np.argmax(h, axis=1) == y))


def digest(weights):
    h = hashlib.sha256()
    for w in weights:
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()[:16]


def history_json(history):
    return {"epoch": list(history.epoch),
            "logs": {k: [float(v) for v in vs] for k, vs in history.history.items()}}


def write_json(name, payload):
    tmp = os.path.join(OUT, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, os.path.join(OUT, name))


X, Y, X_HELD, Y_HELD = data(SPEC)

if MODE == "baseline":
    import keras
    model = build(keras, SPEC)
    began = time.time()
    history = model.fit(X, Y, batch_size=SPEC["batch"], epochs=SPEC["epochs"], shuffle=False,
                        verbose=0)
    weights = model.get_weights()
    write_json("baseline.json", {"history": history_json(history), "seconds": time.time() - began,
                                 "accuracy": accuracy(weights, X_HELD, Y_HELD),
                                 "digest": digest(weights)})
    sys.exit(0)

import bps_tf  # noqa: E402
import keras  # noqa: E402
from bps_tf.runtime import elastic_core  # noqa: E402

LAUNCH_ID = os.environ.get("BYTEPS_LAUNCH_ID", "?")
strategy = bps_tf.BytePSStrategy(elastic=True)
with strategy.scope():
    model = build(keras, SPEC)
    model.optimizer.build(model.trainable_variables)


class Progress(keras.callbacks.Callback):
    """Logs every attempt, batch and epoch end; stops where stop.json says."""

    def __init__(self):
        super().__init__()
        self.out = open(os.path.join(OUT, f"progress_{LAUNCH_ID}.jsonl"), "a", buffering=1)
        self.epoch, self.m, self.n = 0, 0, 0

    def _log(self, kind, **fields):
        fields.update(k=kind, t=time.time(), e=self.epoch, m=self.m, n=self.n)
        self.out.write(json.dumps(fields) + "\n")

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch, self.m, self.n = epoch, elastic_core.epoch(), strategy.num_workers
        self._log("begin", r=strategy.rank)

    def on_train_batch_end(self, batch, logs=None):
        self._log("b", b=batch)

    def on_epoch_end(self, epoch, logs=None):
        self._log("end", acc=float((logs or {}).get("accuracy", float("nan"))))
        try:
            with open(os.path.join(OUT, "stop.json")) as f:
                last = int(json.load(f)["last_epoch"])
        except FileNotFoundError:
            return
        if epoch >= last:
            self.model.stop_training = True


history = model.fit(X, Y, batch_size=SPEC["batch"], epochs=SPEC["max_epochs"], shuffle=False,
                    callbacks=[Progress()], verbose=0)
weights = model.get_weights()
write_json(f"done_{LAUNCH_ID}.json", {
    "history": history_json(history), "accuracy": accuracy(weights, X_HELD, Y_HELD),
    "digest": digest(weights), "rank": strategy.rank, "size": strategy.num_workers,
    "newcomer": os.environ.get("BYTEPS_ELASTIC_NEWCOMER") == "1"})
