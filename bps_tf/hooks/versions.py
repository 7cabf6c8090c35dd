"""The Keras and TensorFlow versions bps_tf was verified on, and what it says
about the versions it runs with (docs/dependencies.md#versions-the-matrix).

* older than the floor (Keras 3.10): refused, naming what is missing;
* newer than the last verified release (and not a verified pre-release):
  one warning per process naming both versions and the last verified ones;
  every hook is still found by role and a moved one is reported, but
  nothing newer has run the version matrix.

No TensorFlow or Keras is imported here: the versions of the loaded ones are
read from ``sys.modules``.
"""
from __future__ import annotations

import logging
import re
import sys
import threading
from typing import Optional, Tuple

from bps_tf.hooks.errors import HookError

log = logging.getLogger("bps_tf")

# The oldest Keras 3 every hook was verified on (docs/dependencies.md).
# 3.8 and 3.9 keep metric variables synchronized on write, not on read, and
# evaluate()'s global metrics came out wrong with them (docs/dependencies.md).
MIN_KERAS = (3, 10)
VERIFIED_KERAS = "3.10.0-3.15.1, 3.16.0.dev2026102704"
VERIFIED_TF = "2.16.2-2.21.0, 2.22.0rc0"
# The newest releases the version matrix ran (tools/compat_matrix.py), and
# the pre-releases past them it ran too.
LAST_VERIFIED = {"keras": (3, 15, 1), "tensorflow": (2, 21, 0)}
VERIFIED_PRERELEASES = {"keras": ("3.16.0.dev2026102704",), "tensorflow": ("2.22.0rc0",)}

_said = threading.Event()


def keras_version() -> str:
    module = sys.modules.get("keras")
    return getattr(module, "__version__", "not loaded") if module else "not loaded"


def tensorflow_version() -> str:
    module = sys.modules.get("tensorflow")
    return getattr(module, "__version__", "not loaded") if module else "not loaded"


def release(version: str) -> Optional[Tuple[int, ...]]:
    """(major, minor, patch) of a version text ("3.16.0.dev2026102704" ->
    (3, 16, 0)); None when it starts with no number."""
    found = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version or "")
    if not found:
        return None
    return tuple(int(p or 0) for p in found.groups())


def newer_than_verified(package: str, version: str) -> bool:
    """Whether ``version`` of ``package`` ("keras", "tensorflow") is past the
    last verified release and not a verified pre-release."""
    found = release(version)
    if found is None or version in VERIFIED_PRERELEASES[package]:
        return False
    return found > LAST_VERIFIED[package]


def check_keras_version() -> None:
    """Raises if the loaded Keras 3 is older than every verified one."""
    version = keras_version()
    parts = release(version)
    if parts is None:
        return     # a development build without a plain number: the hooks decide
    if parts[0] == 3 and parts[:2] < MIN_KERAS:
        raise HookError(
            f"BytePSStrategy needs Keras >= {'.'.join(map(str, MIN_KERAS))} (found {version}): "
            f"older Keras 3 releases lack what bps_tf relies on (before 3.10 metric variables "
            f"are synchronized on write, and evaluate()'s global metrics would be wrong; "
            f"before 3.8 the epoch iterator cannot be reset). pip install "
            f"'keras>={'.'.join(map(str, MIN_KERAS))}'.")


def warn_if_newer() -> bool:
    """One warning per process when the loaded Keras or TensorFlow is newer
    than the last verified release; whether this call gave it."""
    versions = {"keras": keras_version(), "tensorflow": tensorflow_version()}
    newer = [p for p, v in versions.items() if newer_than_verified(p, v)]
    if not newer or _said.is_set():
        return False
    _said.set()
    names = {"keras": "Keras", "tensorflow": "TensorFlow"}
    shown = ", ".join(f"{names[p]} {versions[p]} (last verified: "
                      f"{'.'.join(map(str, LAST_VERIFIED[p]))}, and "
                      f"{', '.join(VERIFIED_PRERELEASES[p])})" for p in newer)
    log.warning("bps_tf: %s newer than any bps_tf was verified on: every hook into Keras and "
                "TensorFlow is still found by its role and a moved one is reported, but this "
                "combination has not run bps_tf's version matrix (docs/dependencies.md). "
                "Please report what you see.", shown + (" is" if len(newer) == 1 else " are"))
    return True
