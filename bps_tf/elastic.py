"""``hvd.elastic``: Horovod's elastic state objects (bps_tf.horovod.elastic)."""
from bps_tf.horovod.elastic import *  # noqa: F401,F403
from bps_tf.horovod.elastic import __all__  # noqa: F401
