"""One worker of the Keras benchmark: `model.fit` on synthetic images under
BytePSStrategy, timing every training step.

Usage: keras_fit.py SPEC.json. With DMLC_* set it joins a bps_tf cluster;
without, it trains alone (BytePSStrategy of one worker, no servers), which
is also how the single-worker and the independent baselines run. Writes
OUT_DIR/worker<rank>.json (rank from BENCH_RANK when alone).

spec: model ("resnet50" | "small_cnn" | "mlp" | "vgg_small" | "frozen_backbone"; mlp_width, mlp_depth:
the units and layers of the mlp, mlp_width the vgg_small's dense units), image_size, batch_per_worker,
warmup_steps, steps, threads (TF intra-op threads), priority ("on" | "off"),
overlap (BytePSStrategy(overlap=...), default false), comm_only (no
training: the same gradient set pushed and pulled every step, in the
order a backward pass produces it -- the communication-only time).
"""
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf


def configure_threads(threads: int) -> None:
    # Every worker gets the same CPU share, alone or not, so that only the
    # communication differs between the single-worker run and the cluster.
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(max(2, threads))


def turn_priorities_off() -> None:
    """FIFO instead of priority scheduling (the supported switch)."""
    os.environ["BYTEPS_PRIORITY_SCHEDULING"] = "0"


def build_model(keras, name: str, size: int, width: int = 512, depth: int = 8):
    if name == "mlp":
        # Equal layers: every layer holds the same share of the bytes and of
        # the compute, so after the backward pass most of the gradients are
        # still on the wire -- the case cross-step overlap is for (the
        # CNN's bytes sit in its last layers, which the barrier already
        # hides behind the earlier layers' backward pass).
        inputs = keras.Input((size, size, 3))
        x = keras.layers.Flatten()(inputs)
        x = keras.layers.Dense(width, activation="relu")(x)
        for _ in range(depth - 2):
            x = keras.layers.Dense(width, activation="relu")(x)
        return keras.Model(inputs, keras.layers.Dense(1000)(x))
    if name in ("vgg_small", "frozen_backbone"):
        # VGG's shape: convolutions that hold the compute and few bytes,
        # then fully connected layers that hold the bytes and little
        # compute. The big gradients come first in the backward pass; the
        # convolutions' small ones come last and are needed first.
        # frozen_backbone: fine-tuning a head on a frozen feature extractor
        # (transfer learning): the convolutions train nothing, so the
        # backward pass is short and under a barrier the exchange waits
        # after it; with cross-step overlap the next step's backbone forward
        # (whose weights never change) runs while the head's gradients travel.
        trainable = name == "vgg_small"
        inputs = keras.Input((size, size, 3))
        x = inputs
        for filters in (32, 64, 128, 128):
            x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu",
                                    trainable=trainable)(x)
            x = keras.layers.MaxPooling2D()(x)
        x = keras.layers.Flatten()(x)
        x = keras.layers.Dense(width, activation="relu")(x)
        x = keras.layers.Dense(width, activation="relu")(x)
        return keras.Model(inputs, keras.layers.Dense(1000)(x))
    if name == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=(size, size, 3),
                                           classes=1000, classifier_activation=None)
    # A small CNN: compute-bound, few parameters (the easy case for scaling).
    layers = keras.layers
    inputs = keras.Input((size, size, 3))
    x = inputs
    for filters in (32, 64, 128):
        x = layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        x = layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        x = layers.MaxPooling2D()(x)
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(1000)(x)
    return keras.Model(inputs, outputs)


def cpu_sample():
    """(this process's CPU seconds, the machine's busy and total jiffies):
    where a step's time goes on a machine whose cores every process shares."""
    with open("/proc/stat") as f:
        # user nice system idle iowait irq softirq steal (guest time is
        # already inside user and nice)
        fields = [int(v) for v in f.readline().split()[1:9]]
    idle = fields[3] + fields[4]
    return time.process_time(), sum(fields) - idle, sum(fields)


class StepTimer:
    """Wall-clock time at the end of every training batch."""

    def __init__(self, keras):
        class _Timer(keras.callbacks.Callback):
            def __init__(inner):
                super().__init__()
                inner.times = []
                inner.cpu = []

            def on_train_begin(inner, logs=None):
                inner.times.append(time.perf_counter())
                inner.cpu.append(cpu_sample())

            def on_train_batch_end(inner, batch, logs=None):
                inner.times.append(time.perf_counter())
                inner.cpu.append(cpu_sample())
        self.callback = _Timer()


def communicate_only(model, steps):
    """Step times of push_pulls of every gradient's shape, without compute:
    the last layer's gradient is ready first, the first layer's gets the
    highest priority (what the graph's priority pass gives it)."""
    import bps_tf
    grads = [tf.zeros(v.shape, v.dtype) for v in model.trainable_variables]

    @tf.function
    def step():
        n = len(grads)
        return [bps_tf.push_pull(grads[i], average=False, name=f"comm_only/{i}", priority=-i)
                for i in reversed(range(n))]

    times, cpu = [time.perf_counter()], [cpu_sample()]
    for _ in range(steps):
        outs = step()
        _ = [o.numpy() for o in outs[:1]]
        times.append(time.perf_counter())
        cpu.append(cpu_sample())
    return times, cpu


def main():
    spec = json.load(open(sys.argv[1]))
    configure_threads(spec["threads"])
    if spec.get("priority", "on") == "off":
        turn_priorities_off()
    import keras
    import bps_tf

    strategy = bps_tf.BytePSStrategy(overlap=bool(spec.get("overlap", False)))
    rank = bps_tf.rank() if bps_tf.size() > 1 else int(os.environ.get("BENCH_RANK", "0"))
    workers = bps_tf.size()
    keras.utils.set_random_seed(0)
    size, per_worker = spec["image_size"], spec["batch_per_worker"]
    global_batch = per_worker * workers
    steps = spec["warmup_steps"] + spec["steps"]
    rng = np.random.default_rng(0)
    # Enough distinct images for every step of the epoch: no repeat, no
    # input-pipeline surprises; each worker reads its shard of every batch.
    x = rng.standard_normal((global_batch * steps, size, size, 3), dtype=np.float32)
    y = rng.integers(0, 1000, size=(global_batch * steps,)).astype(np.int64)

    with strategy.scope():
        model = build_model(keras, spec["model"], size, spec.get("mlp_width", 512),
                            spec.get("mlp_depth", 8))
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
    if spec.get("comm_only"):
        times, cpu = communicate_only(model, steps)
    else:
        timer = StepTimer(keras).callback
        model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=[timer])
        times, cpu = timer.times, timer.cpu
    first = 1 + spec["warmup_steps"]
    timed = times[first:]
    step_s = np.diff(timed).tolist()
    (proc0, busy0, total0), (proc1, busy1, total1) = cpu[first], cpu[-1]
    result = {"rank": rank, "workers": workers, "batch_per_worker": per_worker,
              "params": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
              "gradients": len(model.trainable_variables), "step_s": step_s,
              "first_step_s": times[1] - times[0],
              # CPU seconds this process used per timed step, and the share
              # of the machine's cores busy meanwhile (all processes).
              "cpu_s_per_step": (proc1 - proc0) / len(step_s),
              "machine_busy": (busy1 - busy0) / max(1, total1 - total0)}
    out = os.path.join(spec["out_dir"], f"worker{rank}.json")
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main()
