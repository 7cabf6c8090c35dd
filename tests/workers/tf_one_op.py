"""A TensorFlow worker that runs one push_pull through the op library."""
import sys

import tensorflow as tf

import bps_tf
from bps_tf import ops

bps_tf.init()
out = ops.push_pull_sum(tf.constant([1.0, 2.0]), "one_op")
expect = [bps_tf.size() * 1.0, bps_tf.size() * 2.0]
sys.exit(0 if out.numpy().tolist() == expect else 1)
