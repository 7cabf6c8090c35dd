"""``bpslaunch``: starts a local cluster of servers and workers, or this
machine's role of a TF_CONFIG / DMLC_* cluster (``python -m bps_tf.launch``)."""
