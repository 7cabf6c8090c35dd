"""Faces of bps_tf for older TensorFlow APIs: ``bps_tf.compat.v1`` (TF1 sessions)."""
