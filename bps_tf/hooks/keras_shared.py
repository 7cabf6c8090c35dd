"""Keras behaviour both faces of bps_tf adjust (``BytePSStrategy`` and the
Horovod Keras face, ``bps_tf.keras``), declared in the hook registry:

* ``compile(experimental_run_tf_function=...)`` is accepted (Horovod's Keras
  examples pass it; Keras 3 raises on it);
* only rank 0 draws the progress bar (``BYTEPS_PROGRESS_ALL_RANKS=1``: all);
* a Keras variable's path is known while it creates its TensorFlow variable,
  to label its push_pulls in errors and the timeline (:func:`creating_path`);
* under ``TF_USE_LEGACY_KERAS=1``, ``tf.keras`` gets tf_keras' version.

:func:`install` installs them once per process and says, once, when Keras
or TensorFlow is newer than the last verified release.
"""
from __future__ import annotations

import contextlib
import functools
import threading

from bps_tf.hooks import registry, versions
from bps_tf.runtime import basics, config

GROUP = "keras.shared"
_creating = threading.local()


@registry.register("keras.Model.compile", GROUP,
                   # Wrapped where it is defined: Keras compiles a loaded model only
                   # if type(model).compile is still its own base trainer's.
                   registry.attribute_of("keras.Model", "compile", defined_by_role=True),
                   changes="drops experimental_run_tf_function= (Horovod's Keras examples pass "
                           "it)", why="Keras 3 raises on the argument Keras 2 ignored",
                   when_missing="cosmetic")
def _compile(original):
    @functools.wraps(original)
    def compile(self, *args, experimental_run_tf_function=None, **kwargs):  # noqa: A001
        del experimental_run_tf_function
        return original(self, *args, **kwargs)
    return compile


@registry.register("keras.callbacks.ProgbarLogger.set_params", GROUP,
                   registry.attribute_of("keras.callbacks.ProgbarLogger", "set_params"),
                   changes="only rank 0 draws the progress bar (BYTEPS_PROGRESS_ALL_RANKS=1: "
                           "all)", why="Keras draws one bar per process; N identical bars "
                                       "interleave", when_missing="cosmetic")
def _set_params(original):
    @functools.wraps(original)
    def set_params(self, params):
        original(self, params)
        if (basics.is_initialized() and basics.size() > 1 and basics.rank() != 0
                and not config.value("BYTEPS_PROGRESS_ALL_RANKS")):
            self.verbose = 0
    return set_params


@registry.register("keras.Variable._initialize", GROUP,
                   registry.attribute_of("keras.Variable", "_initialize", defined_by_role=True),
                   changes="the Keras path labels a variable's push_pulls in errors and the "
                           "timeline", why="Keras may create the TensorFlow variable after the "
                                           "layer's name scope is gone",
                   when_missing="cosmetic", private=True)
def _initialize(original):
    @functools.wraps(original)
    def _initialize(self, value):
        with creating_variable(getattr(self, "path", None)):
            return original(self, value)
    return _initialize


@contextlib.contextmanager
def creating_variable(path):
    """While a Keras variable creates its TensorFlow variable: its path."""
    previous = getattr(_creating, "path", None)
    _creating.path = path
    try:
        yield
    finally:
        _creating.path = previous


def creating_path():
    """The Keras path of the variable being created now, or None."""
    return getattr(_creating, "path", None)


def _tf_keras_loader():
    if not config.tf_keras_enabled():
        raise registry.HookMissing("tf.keras is Keras 3 (TF_USE_LEGACY_KERAS is not set)")
    import tensorflow as tf
    return tf.keras, "__version__"


_tf_keras_loader.found_by = "public name tf.keras (tf_keras' loader, TF_USE_LEGACY_KERAS=1)"
_tf_keras_loader.keras_name = ""
registry.probe("tf.keras.__version__", "tf_keras", _tf_keras_loader,
               changes="tf.keras (a lazy loader for tf_keras) reports tf_keras' version",
               why="Keras-2-era scripts read tf.keras.__version__ to choose their optimizer API "
                   "(Horovod's Keras tests do); TensorFlow 2.16+'s loader has none",
               when_missing="cosmetic", private=False, kind="patches")


def give_tf_keras_a_version() -> None:
    """Under ``TF_USE_LEGACY_KERAS=1``, TensorFlow 2.16+'s ``tf.keras`` (a
    lazy loader for tf_keras) has no ``__version__``, which Keras-2-era
    scripts read to choose their optimizer API (Horovod's Keras tests do,
    e.g. ``version.parse(tf.keras.__version__) < "2.11"``). It gets tf_keras'
    version; nothing else of TensorFlow's namespace changes."""
    if not config.tf_keras_enabled() or not registry.locate_entry("tf.keras.__version__"):
        return
    import tensorflow as tf
    if getattr(tf.keras, "__version__", None) is None:
        import tf_keras
        tf.keras.__version__ = tf_keras.__version__


def install() -> None:
    """Installs the hooks both faces share (once per process)."""
    import keras  # noqa: F401  (the hooks' targets)
    versions.check_keras_version()
    versions.warn_if_newer()
    registry.install(GROUP)
    give_tf_keras_a_version()
