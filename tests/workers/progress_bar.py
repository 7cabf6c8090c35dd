"""Trains one short model.fit with the default verbose; the test reads the output."""
import numpy as np
import keras

import bps_tf

strategy = bps_tf.BytePSStrategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
x = np.ones((64, 4), np.float32)
model.fit(x, x[:, :1], batch_size=16, epochs=2)
print(f"FIT_DONE rank={bps_tf.rank()}", flush=True)
