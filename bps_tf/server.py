"""`python -m bps_tf.server`: run this node's server (or scheduler) role
(bps_tf.runtime.server; no TensorFlow)."""
import sys

from bps_tf.runtime.server import main

if __name__ == "__main__":
    sys.exit(main())
