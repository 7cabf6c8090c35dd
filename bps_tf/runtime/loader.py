"""Loads the native core: libzmq and libsodium first (from pyzmq's wheel),
then bps_tf._core.

The core is built without linking libzmq or libsodium (see
docs/dependencies.md), so their symbols must be global in the process before
libbps_core.so loads. pyzmq's wheel ships both under hashed file names that
change between releases, so they are found at run time rather than at build
time. libsodium is optional here: only BYTEPS_ENCRYPTION=1 needs it, and the
core says so, naming the fix, when it is missing.
"""
from __future__ import annotations

import ctypes
import glob
import importlib
import importlib.util
import os

_zmq_handle = None
_sodium_handle = None


def _pyzmq_libs(stem: str) -> list[str]:
    spec = importlib.util.find_spec("zmq")  # locates pyzmq without importing it
    if spec is None or not spec.submodule_search_locations:
        return []
    site = os.path.dirname(list(spec.submodule_search_locations)[0])
    return sorted(glob.glob(os.path.join(site, "pyzmq.libs", stem + "*.so*")))


def _pyzmq_libzmq() -> list[str]:
    return _pyzmq_libs("libzmq")


def _then_system(first: list[str], name: str, last: list[str]):
    """`first`, then the system's library `name`, then `last`: the system's is
    looked up only when none of `first` loads, since ctypes.util.find_library
    runs ldconfig (and gcc when that fails) in subprocesses, which cost each
    of a few hundred processes of a job a tenth of a second of CPU."""
    yield from first
    import ctypes.util   # here: it imports subprocess, tempfile and more, ~10 ms a process
    system = ctypes.util.find_library(name)
    if system:
        yield system
    yield from last


def preload_libzmq() -> str:
    """Makes libzmq's symbols global; returns the path used."""
    global _zmq_handle
    if _zmq_handle is not None:
        return _zmq_handle._name
    errors = []
    for path in _then_system(_pyzmq_libzmq(), "zmq", ["libzmq.so.5"]):
        try:
            _zmq_handle = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path
        except OSError as exc:
            errors.append(f"{path}: {exc}")
    raise ImportError(
        "bps_tf needs libzmq: install pyzmq (`pip install pyzmq`), whose wheel ships it. "
        "Tried: " + "; ".join(errors or ["no candidate found"]))


def _mapped_libsodium() -> list[str]:
    """libsodium files already mapped into this process (e.g. by libzmq)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libsodium" in line.split()[-1]}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


def preload_libsodium() -> str:
    """Makes libsodium's symbols global, for the sealed links of
    BYTEPS_ENCRYPTION=1; returns the path used, or "" when none loads (the
    core then refuses that setting with what to install)."""
    global _sodium_handle
    if _sodium_handle is not None:
        return _sodium_handle._name
    for path in _then_system(_pyzmq_libs("libsodium") + _mapped_libsodium(), "sodium",
                             ["libsodium.so.26", "libsodium.so.23"]):
        try:
            _sodium_handle = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path
        except OSError:
            continue
    return ""


def load_core():
    preload_libzmq()
    preload_libsodium()
    try:
        return importlib.import_module("bps_tf._core")
    except ImportError as exc:
        shadowed = _shadowing_source_tree()
        if shadowed:
            raise ImportError(shadowed) from exc
        raise ImportError(
            f"bps_tf's native core is not built ({exc}). Install bps_tf with "
            "`pip install .` or build in place with "
            "`python setup.py build_ext --inplace`.") from exc


def _shadowing_source_tree() -> str:
    """The message for a bps_tf source folder imported instead of the
    installed package (a script run from the clone's root: Python puts the
    script's folder first on sys.path), or "" when that is not the case."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.dirname(package)
    if not os.path.exists(os.path.join(root, "setup.py")):
        return ""      # an installed package that lacks its core: not shadowing
    installed = ""
    try:
        from importlib import metadata
        dist = metadata.distribution("bps_tf")
        location = os.path.join(str(dist.locate_file("")), "bps_tf")
        if os.path.realpath(location) != os.path.realpath(package) and \
                os.path.isdir(location):
            installed = location
    except Exception:  # pylint: disable=broad-except  (no metadata: not installed)
        installed = ""
    where = (f"bps_tf is installed (in {installed}), but " if installed else "")
    return (f"{where}Python imported bps_tf from the source folder {package}, which has no "
            f"built native core: a script in the clone's root (or a working directory there) "
            f"puts the folder first on sys.path. Run from another directory, or build in "
            f"place with `python setup.py build_ext --inplace`.")
