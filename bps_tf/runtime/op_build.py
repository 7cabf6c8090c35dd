"""Builds the TensorFlow op library against the TensorFlow that loads it.

TensorFlow's C++ ABI changes with every release, so an op library is only
valid for the exact TensorFlow (version and compile flags) it was compiled
against. Every build is therefore stamped with a *key*: a hash of the
TensorFlow version, its compile and link flags, and the op sources. At import, `ensure_op_library()` returns

1. the library built at install time, when its stamp matches this process's
   TensorFlow (the common case: `pip install --no-build-isolation .`), else
2. a library in the per-user cache (``$BPS_TF_CACHE_DIR``, default
   ``$XDG_CACHE_HOME/bps_tf`` or ``~/.cache/bps_tf``) under that key, compiled
   there on first use. A file lock makes several workers that start together
   build it once; the others wait and then load it.

A stale build is never reused: a TensorFlow upgrade changes the key, which
selects (or builds) another library. setup.py imports this file by path
(without importing bps_tf) to build at install time with the same commands.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Sequence

# This file is bps_tf/runtime/op_build.py; sources are named from bps_tf/.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The op library's sources, relative to the package directory. They ship
# with the package so the library can be compiled where it is used.
OP_SOURCES = ("ops/push_pull_ops.cc", "ops/priority_pass.cc", "ops/priority_pass_stats.cc",
              "ops/graph_rewrite.cc", "ops/sparse_gather.cc", "ops/overlap_ops.cc",
              "kernels/push_pull_kernels.cc", "kernels/overlap_kernels.cc")
# Include roots. Of the core, the op library includes only the contract at
# the root of core/ (bps_api.h, dtypes.h; tests/test_structure_native.py),
# never the engine's folders: the key hashes the headers directly in each
# root, so a change inside the engine does not rebuild the op library.
INCLUDE_DIRS = ("core", "kernels", "ops")
LIBRARY_NAME = "libbps_tf_ops.so"
STAMP_SUFFIX = ".key"
WARNINGS = ("-Wall", "-Wno-sign-compare")
# TensorFlow's headers are full of deprecations that are not ours to fix.
TF_HEADER_QUIET = ("-Wno-deprecated-declarations", "-Wno-interference-size")
BUILD_TIMEOUT_S = 900


class BuildError(ImportError):
    """The op library could not be built (no compiler, a compile error...)."""


def tensorflow_info_in_process() -> Dict:
    """Version and build flags of the TensorFlow imported in this process."""
    import tensorflow as tf
    return {"version": tf.__version__,
            "cflags": list(tf.sysconfig.get_compile_flags()),
            "lflags": list(tf.sysconfig.get_link_flags())}


def tensorflow_info_of(python: str) -> Dict:
    """The same, for the TensorFlow that `python` imports (raises if none)."""
    probe = ("import json, tensorflow as tf\n"
             "print(json.dumps({'version': tf.__version__,"
             " 'cflags': tf.sysconfig.get_compile_flags(),"
             " 'lflags': tf.sysconfig.get_link_flags()}))\n")
    out = subprocess.run([python, "-c", probe], check=True, capture_output=True, text=True,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")).stdout
    return json.loads(out.strip().splitlines()[-1])


def compiler() -> str:
    return os.environ.get("CXX", "g++")


def _source_paths(package_dir: str) -> List[str]:
    """What the key hashes: the op sources and every header they can include."""
    paths = [os.path.join(package_dir, s) for s in OP_SOURCES]
    for d in INCLUDE_DIRS:
        full = os.path.join(package_dir, d)
        paths += sorted(os.path.join(full, f) for f in os.listdir(full) if f.endswith(".h"))
    return paths


def build_key(tf_info: Dict, package_dir: str = PACKAGE_DIR) -> str:
    """What an op library must have been built with to load in this process."""
    # The ABI a library must match is TensorFlow's (version and flags) and
    # our sources'; the compiler on PATH today says nothing about a library
    # built before, and asking it would cost every import a subprocess.
    h = hashlib.sha256()
    h.update(json.dumps([tf_info["version"], tf_info["cflags"], tf_info["lflags"]]).encode())
    for path in _source_paths(package_dir):
        h.update(os.path.relpath(path, package_dir).encode())
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:20]


def compile_commands(tf_info: Dict, package_dir: str, obj_dir: str, out_path: str,
                     core_lib_dir: str, cxx: str = None) -> List[List[str]]:
    """One compile command per source, then the link; objects go to obj_dir."""
    cxx = cxx or compiler()
    base = [cxx, "-std=c++17", "-O3", "-fPIC", "-pthread", "-DNDEBUG", *WARNINGS]
    cflags = [f for f in tf_info["cflags"] if not f.startswith("--std")]
    includes = ["-I" + os.path.join(package_dir, d) for d in INCLUDE_DIRS]
    cmds, objs = [], []
    for src in OP_SOURCES:
        obj = os.path.join(obj_dir, os.path.basename(src) + ".o")
        cmds.append(base + cflags + includes + list(TF_HEADER_QUIET)
                    + ["-c", os.path.join(package_dir, src), "-o", obj])
        objs.append(obj)
    cmds.append(base + ["-shared", "-o", out_path] + objs + link_flags(tf_info, core_lib_dir))
    return cmds


def link_flags(tf_info: Dict, core_lib_dir: str) -> List[str]:
    # The core is loaded first (RTLD_GLOBAL) by bps_tf.runtime.basics; the rpath is
    # for tools that load the op library alone.
    return ["-L" + core_lib_dir, "-lbps_core", "-Wl,-rpath," + core_lib_dir] + tf_info["lflags"]


def run_commands(cmds: Sequence[Sequence[str]], parallel: bool = True, echo=None) -> None:
    """Runs the compile commands (in parallel) and then the link command."""
    *compiles, link = cmds
    procs = []
    try:
        for cmd in compiles:
            if echo:
                echo(" ".join(cmd))
            procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT, text=True)))
            if not parallel:
                _finish(*procs[-1])
        for cmd, proc in procs:
            _finish(cmd, proc)
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if echo:
        echo(" ".join(link))
    _finish(link, subprocess.Popen(link, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True))


def _finish(cmd, proc):
    try:
        out, _ = proc.communicate(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise BuildError(f"compiling bps_tf's op library took over {BUILD_TIMEOUT_S} s: "
                         + " ".join(cmd))
    if proc.returncode != 0:
        raise BuildError("compiling bps_tf's op library failed:\n  " + " ".join(cmd)
                         + "\n" + out[-4000:])


def write_stamp(lib_path: str, key: str, tf_version: str) -> None:
    with open(lib_path + STAMP_SUFFIX, "w") as f:
        json.dump({"key": key, "tensorflow": tf_version}, f)


def read_stamp(lib_path: str) -> Dict:
    try:
        with open(lib_path + STAMP_SUFFIX) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def cache_root() -> str:
    explicit = os.environ.get("BPS_TF_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "bps_tf")


@contextlib.contextmanager
def _locked(path: str):
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_op_library(package_dir: str = PACKAGE_DIR, tf_info: Dict = None,
                      core_lib_dir: str = None, log=None) -> str:
    """Path of an op library built for this process's TensorFlow (see module doc)."""
    tf_info = tf_info or tensorflow_info_in_process()
    core_lib_dir = core_lib_dir or package_dir
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    cxx = compiler()
    key = build_key(tf_info, package_dir)
    installed = os.path.join(package_dir, "ops", LIBRARY_NAME)
    if os.path.exists(installed) and read_stamp(installed).get("key") == key:
        return installed
    target_dir = os.path.join(cache_root(), f"tf{tf_info['version']}-{key}")
    target = os.path.join(target_dir, LIBRARY_NAME)
    if read_stamp(target).get("key") == key and os.path.exists(target):
        return target
    if shutil.which(cxx) is None:
        raise BuildError(
            f"bps_tf must compile its TensorFlow op library for TensorFlow {tf_info['version']} "
            f"(once), but the C++ compiler {cxx!r} was not found: install g++ "
            "(e.g. `apt-get install g++`) or set CXX to a C++17 compiler.")
    os.makedirs(target_dir, exist_ok=True)
    with _locked(os.path.join(target_dir, ".lock")):
        # Another process may have built it while this one waited.
        if read_stamp(target).get("key") == key and os.path.exists(target):
            return target
        why = ("was built for another TensorFlow"
               if os.path.exists(installed) else "was not built at install")
        log(f"bps_tf: the installed op library {why}; compiling it for TensorFlow "
            f"{tf_info['version']} into {target_dir} (once; about a minute)...")
        start = time.time()
        with tempfile.TemporaryDirectory(dir=target_dir, prefix=".build-") as tmp:
            partial = os.path.join(tmp, LIBRARY_NAME)
            run_commands(compile_commands(tf_info, package_dir, tmp, partial, core_lib_dir,
                                          cxx))
            os.replace(partial, target)  # atomic: readers never see half a library
        write_stamp(target, key, tf_info["version"])
        log(f"bps_tf: op library ready ({time.time() - start:.0f} s).")
    return target


def main(argv=None) -> None:
    """`python -m bps_tf.runtime.op_build`: build (or find) the op library now, e.g. in
    a container image, so that no worker compiles it at start-up.
    `--stamp PATH`: mark an op library built by other means (Bazel) against
    this environment's TensorFlow as built for it."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m bps_tf.runtime.op_build")
    parser.add_argument("--stamp", metavar="LIBRARY",
                        help="stamp LIBRARY as built for this TensorFlow instead of building")
    args = parser.parse_args(argv)
    if args.stamp:
        info = tensorflow_info_in_process()
        package_dir = os.path.dirname(os.path.dirname(os.path.abspath(args.stamp)))
        write_stamp(args.stamp, build_key(info, package_dir), info["version"])
        print(args.stamp + STAMP_SUFFIX)
        return
    print(ensure_op_library())


if __name__ == "__main__":
    main()
