"""Single-process BytePSStrategy checks for test_strategy.py (no cluster).

    python tests/workers/strategy_single.py

Runs in its own process because it needs 2 logical CPU devices, which
must be configured before TensorFlow starts. Prints one JSON line:

* ``priorities``: (variable, priority the kernel receives) of each gradient
  push_pull in the Keras train step of a model whose layers are created in the
  reverse of the order they are called in;
* ``forward_order``: the variables in the order the model reads them;
* ``jit_compile``: the model's jit_compile after compile(jit_compile=True);
* ``replicas``, ``should_checkpoint``, ``trained``;
* ``bad_predict``: the error of ``BytePSStrategy(predict="gather")``.
"""
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

from bps_tf.ops import pass_record  # noqa: E402
from bps_tf.strategy import BytePSStrategy  # noqa: E402


class Reversed(keras.Model):
    """Creates its layers last-to-first; calls them first-to-last."""

    def __init__(self):
        super().__init__()
        self.out = keras.layers.Dense(3, name="out")
        self.bn = keras.layers.BatchNormalization(synchronized=True, name="bn")
        self.middle = keras.layers.Dense(5, name="middle")
        self.embed = keras.layers.Embedding(10, 4, name="embed")

    def call(self, tokens, training=None):
        h = keras.ops.mean(self.embed(tokens), axis=1)
        h = self.middle(h)
        h = self.bn(h, training=training)
        return self.out(h)


def main():
    strategy = BytePSStrategy(devices=["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = Reversed()
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=True)
    tokens = np.random.RandomState(0).randint(0, 10, size=(16, 3)).astype("int32")
    labels = np.arange(16) % 3
    history = model.fit(tokens, labels, batch_size=8, epochs=1, verbose=0)
    names = {id(v.value.values[0]): v.path for v in model.trainable_variables}
    found = strategy.extended._push_pull_ops  # pylint: disable=protected-access
    # the priority each push_pull kernel receives: set by the C++ priority pass
    received = pass_record.priorities()
    priorities = {}
    for graph, applied in found._applied.items():  # pylint: disable=protected-access
        for entry in applied:
            for op_name in entry.op_names:
                tensor_name = graph.get_operation_by_name(op_name).get_attr("tensor_name")
                priorities.setdefault(names[id(entry.variable)], set()).add(
                    received[tensor_name.decode()])
    try:
        BytePSStrategy(devices=["/cpu:0"], predict="gather")
        bad_predict = "no error"
    except ValueError as exc:
        bad_predict = str(exc)
    print(json.dumps({
        "bad_predict": bad_predict,
        "priorities": {k: sorted(v) for k, v in priorities.items()},
        "forward_order": ["embed/embeddings", "middle/kernel", "middle/bias", "bn/gamma",
                          "bn/beta", "out/kernel", "out/bias"],
        "declared_order": [v.path for v in model.trainable_variables],
        "jit_compile": bool(model.jit_compile),
        "replicas": strategy.num_replicas_in_sync,
        "should_checkpoint": bool(strategy.extended.should_checkpoint),
        "trained": bool(np.isfinite(history.history["loss"][0])),
    }), flush=True)


if __name__ == "__main__":
    main()
