"""``BytePSStrategy``: Keras 3 ``model.fit`` across workers, unchanged
(docs/strategy.md). The strategy and its extended class, the cross-device
ops, the checks every worker agrees on, predictions for every row, and the
hooks into Keras that the ``tf.distribute`` contract cannot express."""
from bps_tf.strategy.byteps_strategy import (BytePSExtended, BytePSStrategy, PushPullCrossDeviceOps,
                                             gather_predictions)

__all__ = ["BytePSStrategy", "BytePSExtended", "PushPullCrossDeviceOps", "gather_predictions"]
