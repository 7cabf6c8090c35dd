"""bps_tf's hooks into Keras and TensorFlow: the one registry of every name
of theirs bps_tf touches that they do not promise to keep (``registry``,
with the handles of ``entries``), the versions verified (``versions``), the
roles that find moved classes (``roles``), TensorFlow's internals
(``tf_internals``) and the hooks both Keras faces share (``keras_shared``).

A layer above ``runtime/`` (it may import TensorFlow and Keras, lazily) and
below everything that touches them: the op wrappers, ``comm/`` and the faces.
"""
