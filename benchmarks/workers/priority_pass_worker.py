"""Child of benchmarks/priority_pass_cost.py: trains ResNet-50 without and with
BytePSStrategy (one process, 2 local replicas, no cluster) and prints the priority pass's own
cost record (bps_priority_pass_stats_json) of each phase as one JSON line.

Run from a neutral directory so the installed bps_tf is imported.
"""
import ctypes
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

# Two local replicas: with one device and one worker TensorFlow skips the
# cross-device reduction, and the graph would hold no push_pull.
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import bps_tf  # noqa: E402
import bps_tf.ops as ops_pkg  # noqa: E402
from bps_tf.strategy import BytePSStrategy  # noqa: E402

_LIB = ctypes.CDLL(ops_pkg.LIBRARY_PATH)   # the op library in use (installed or cached)


def stats(reset=False):
    need = _LIB.bps_priority_pass_stats_json(None, 0)
    buf = ctypes.create_string_buffer(need)
    _LIB.bps_priority_pass_stats_json(buf, need)
    out = json.loads(buf.value.decode())
    if reset:
        _LIB.bps_priority_pass_stats_reset()
    return out


def train(steps, size, batch, strategy=None):
    rng = np.random.RandomState(0)
    x = rng.rand(batch * steps, size, size, 3).astype("float32")
    y = rng.randint(0, 10, size=(batch * steps,))
    scope = strategy.scope() if strategy else tf.init_scope()
    with scope:
        model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=10)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    return time.perf_counter() - start, len(model.trainable_variables)


def main():
    steps, size, batch = (int(a) for a in sys.argv[1:4])
    stats(reset=True)
    tiny = tf.function(lambda a: tf.reduce_sum(tf.sin(a) * 2.0 + 1.0))
    for n in range(1, 51):   # 50 shapes: 50 traces, 50 graphs without push_pull
        tiny(tf.constant(np.zeros([n], np.float32)))
    tiny_stats = stats(reset=True)
    plain_s, _ = train(steps, size, batch)
    plain = stats(reset=True)
    strategy = BytePSStrategy(devices=["/cpu:0", "/cpu:1"])
    bps_s, variables = train(steps, size, batch, strategy)
    with_pp = stats(reset=True)
    print(json.dumps({"tiny_function": tiny_stats, "resnet50_fit_without_strategy": plain,
                      "resnet50_fit_under_strategy": with_pp, "fit_seconds_plain": plain_s,
                      "fit_seconds_strategy": bps_s, "trainable_variables": variables,
                      "steps": steps, "image_size": size, "batch": batch}), flush=True)
    bps_tf.shutdown()


if __name__ == "__main__":
    main()
