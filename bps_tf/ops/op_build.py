"""Builds the TensorFlow op library against the TensorFlow that loads it.

TensorFlow's C++ ABI changes with every release, so an op library is only
valid for the exact TensorFlow (version and compile flags) it was compiled
against. Every build is therefore stamped with a *key*: a hash of what
changes the binary -- the TensorFlow version, its compile and link flags with
TensorFlow's own install folder replaced by a placeholder, and the op sources.
Where TensorFlow or bps_tf is installed changes nothing in the library (it
finds both by their sonames, already loaded), so a new virtual environment
with the same TensorFlow reuses the cached build. At import,
`ensure_op_library()` returns

1. the library built at install time, when its stamp matches this process's
   TensorFlow (the common case: `pip install --no-build-isolation .`), else
2. a library in the per-user cache (``$BPS_TF_CACHE_DIR``, default
   ``$XDG_CACHE_HOME/bps_tf`` or ``~/.cache/bps_tf``) under that key, compiled
   there on first use. A file lock makes several workers that start together
   build it once; the others wait and then load it.

A stale build is never reused: a TensorFlow upgrade changes the key, which
selects (or builds) another library. setup.py and ``python -m
bps_tf.op_build`` load this file by its path (without importing bps_tf.ops,
which loads the library) to build with the same commands.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Sequence

# This file is bps_tf/ops/op_build.py; sources are named from bps_tf/.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The op library's sources, relative to the package directory. They ship
# with the package so the library can be compiled where it is used.
#
# They compile as two units, each one generated file that includes its
# sources (compile_commands): parsing TensorFlow's headers costs the compiler
# ~10 s per unit, more than most of our files, so eight units took 118 core-s
# and two take ~50. Two, not one, so that both cores of a small machine work.
OP_UNITS = (("ops/priority_pass.cc", "ops/priority_pass_stats.cc", "ops/graph_rewrite.cc"),
            ("ops/push_pull_ops.cc", "ops/overlap_ops.cc", "ops/sparse_gather.cc",
             "kernels/push_pull_kernels.cc", "kernels/overlap_kernels.cc"))
OP_SOURCES = tuple(src for unit in OP_UNITS for src in unit)
# Include roots. Of the core, the op library includes only the contract at
# the root of core/ (bps_api.h, dtypes.h; tests/test_structure_native.py),
# never the engine's folders: the key hashes the headers directly in each
# root, so a change inside the engine does not rebuild the op library.
INCLUDE_DIRS = ("core", "kernels", "ops")
LIBRARY_NAME = "libbps_tf_ops.so"
STAMP_SUFFIX = ".key"
WARNINGS = ("-Wall", "-Wno-sign-compare")
# A source included by a unit is no longer the main file, so GCC would warn
# about its own classes that hold a type of its anonymous namespace.
UNIT_QUIET = ("-Wno-subobject-linkage",)
# TensorFlow's headers are full of deprecations that are not ours to fix.
TF_HEADER_QUIET = ("-Wno-deprecated-declarations", "-Wno-interference-size")
BUILD_TIMEOUT_S = 900
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
BUILD_DIR_PREFIX = ".build-"   # a build's temporary folder, inside the cache entry


class BuildError(ImportError):
    """The op library could not be built (no compiler, a compile error...)."""


def tensorflow_info_in_process() -> Dict:
    """Version, build flags and install folder of the TensorFlow imported in
    this process."""
    import tensorflow as tf
    return {"version": tf.__version__,
            "cflags": list(tf.sysconfig.get_compile_flags()),
            "lflags": list(tf.sysconfig.get_link_flags()),
            "root": os.path.dirname(os.path.abspath(tf.__file__))}


def tensorflow_info_of(python: str) -> Dict:
    """The same, for the TensorFlow that `python` imports (raises if none)."""
    probe = ("import json, os, tensorflow as tf\n"
             "print(json.dumps({'version': tf.__version__,"
             " 'cflags': tf.sysconfig.get_compile_flags(),"
             " 'lflags': tf.sysconfig.get_link_flags(),"
             " 'root': os.path.dirname(os.path.abspath(tf.__file__))}))\n")
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


TF_ROOT_PLACEHOLDER = "<tensorflow>"


def _tensorflow_root(tf_info: Dict) -> str:
    """TensorFlow's install folder: given, or the one its include flag names."""
    if tf_info.get("root"):
        return tf_info["root"].rstrip(os.sep)
    for flag in tf_info["cflags"]:
        path = flag[2:].rstrip(os.sep)
        if flag.startswith("-I") and os.path.basename(path) == "include":
            return os.path.dirname(path)
    return ""


def portable_flags(tf_info: Dict) -> List[List[str]]:
    """TensorFlow's compile and link flags with its install folder replaced
    by a placeholder: what of them changes the binary."""
    root = _tensorflow_root(tf_info)
    return [[f.replace(root, TF_ROOT_PLACEHOLDER) if root else f for f in tf_info[kind]]
            for kind in ("cflags", "lflags")]


def build_key(tf_info: Dict, package_dir: str = PACKAGE_DIR) -> str:
    """What an op library must have been built with to load in this process."""
    # The ABI a library must match is TensorFlow's (version and flags) and
    # our sources'; the compiler on PATH today says nothing about a library
    # built before, and asking it would cost every import a subprocess.
    # Paths are left out: TensorFlow's install folder (a placeholder stands
    # for it in the flags), bps_tf's and the core library's; sources are
    # hashed by their names inside the package.
    h = hashlib.sha256()
    h.update(json.dumps([tf_info["version"], *portable_flags(tf_info), OP_UNITS]).encode())
    for path in _source_paths(package_dir):
        h.update(os.path.relpath(path, package_dir).encode())
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:20]


def compile_commands(tf_info: Dict, package_dir: str, obj_dir: str, out_path: str,
                     core_lib_dir: str, cxx: str = None) -> List[List[str]]:
    """One compile command per unit (OP_UNITS), then the link. Each unit's
    source, which includes its files, is written to obj_dir with its object."""
    cxx = cxx or compiler()
    base = [cxx, "-std=c++17", "-O3", "-fPIC", "-pthread", "-DNDEBUG", *WARNINGS]
    cflags = [f for f in tf_info["cflags"] if not f.startswith("--std")]
    includes = ["-I" + os.path.join(package_dir, d) for d in INCLUDE_DIRS]
    cmds, objs = [], []
    for i, unit in enumerate(OP_UNITS):
        unit_src = write_unit(os.path.join(obj_dir, f"op_unit{i}.cc"), unit)
        obj = unit_src[:-len(".cc")] + ".o"
        # -iquote: the package folder serves the unit's own includes only.
        cmds.append(base + cflags + includes + list(TF_HEADER_QUIET) + list(UNIT_QUIET)
                    + ["-iquote", package_dir, "-c", unit_src, "-o", obj])
        objs.append(obj)
    cmds.append(base + ["-shared", "-o", out_path] + objs + link_flags(tf_info, core_lib_dir))
    return cmds


def write_unit(path: str, includes: Sequence[str]) -> str:
    """Writes `path`, a unit that includes `includes` (one compile for them),
    unless it already says exactly that: its time then tells when the list
    last changed, which an incremental build compares with its object's."""
    text = "// Written by bps_tf's build: one compile for these sources.\n" + "".join(
        f'#include "{src}"\n' for src in includes)
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)
    return path


def link_flags(tf_info: Dict, core_lib_dir: str) -> List[str]:
    # The core is loaded first (RTLD_GLOBAL) by bps_tf.runtime.basics; the rpath is
    # for tools that load the op library alone.
    return ["-L" + core_lib_dir, "-lbps_core", "-Wl,-rpath," + core_lib_dir] + tf_info["lflags"]


def run_commands(cmds: Sequence[Sequence[str]], parallel: bool = True, echo=None) -> None:
    """Runs the compile commands (in parallel) and then the link command.

    However it ends (an error, Ctrl-C, SIGTERM), no compiler outlives it:
    each runs in a process group of its own, so its own children (cc1plus,
    as) are stopped with it, and all are reaped."""
    *compiles, link = cmds
    procs = []
    try:
        for cmd in compiles:
            if echo:
                echo(" ".join(cmd))
            _start_recorded(cmd, procs)
            if not parallel:
                _finish(*procs[-1])
        for cmd, proc in procs:
            _finish(cmd, proc)
        if echo:
            echo(" ".join(link))
        _start_recorded(link, procs)
        _finish(*procs[-1])
    finally:
        with signals_deferred():
            for _, proc in procs:
                _stop_tree(proc)


def _start_recorded(cmd, procs) -> None:
    """Starts `cmd` and records it in `procs` as one step: a Ctrl-C that
    landed between the two would leave a compiler that nobody stops."""
    with signals_deferred():
        procs.append((cmd, _start(cmd)))


def _start(cmd):
    # A group of its own: stopping it reaches the driver's children too. A
    # Ctrl-C in the terminal no longer reaches the compilers directly; the
    # KeyboardInterrupt it raises here stops them (run_commands' finally).
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _group_members(pgid: int) -> List[int]:
    """The live processes of process group `pgid` (from /proc; [] without it)."""
    members = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            continue   # gone meanwhile
        if len(fields) >= 3 and fields[0] not in (b"Z", b"X") and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def _stop_tree(proc, patience_s: float = 5.0) -> None:
    """Ends a compiler driver and what it started, leaving no zombie.

    The driver's children are killed first, while the driver lives to reap
    them (killed together, they would be orphans that only init reaps, and
    some container inits never do); then the driver, which we reap."""
    if proc.poll() is None:
        give_up = time.monotonic() + patience_s
        while proc.poll() is None and time.monotonic() < give_up:
            for pid in _group_members(proc.pid):
                if pid != proc.pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.2)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def signals_deferred():
    """Holds off SIGINT, SIGTERM and SIGHUP during a cleanup, so a second
    Ctrl-C cannot cut it short, then acts on the first that came, as the
    program's own handler would have. Only the main thread runs Python's
    signal handlers; elsewhere nothing can interrupt the cleanup anyway."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came, previous = [], {}
    for signum in STOP_SIGNALS:
        handler = signal.getsignal(signum)
        if handler is not None:   # None: a handler not set from Python; leave it
            previous[signum] = signal.signal(signum, lambda n, _frame: came.append(n))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if came:
            os.kill(os.getpid(), came[0])


class _Stopped(BaseException):
    """SIGTERM or SIGHUP arrived during the build (see stops_cleanly)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def stops_cleanly():
    """SIGTERM and SIGHUP, which by default end the process on the spot,
    unwind the build instead (its finally blocks remove the compilers and the
    temporary folder), and then end the process as they would have. SIGINT
    needs nothing: it raises KeyboardInterrupt."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) == signal.SIG_DFL:
                previous[signum] = signal.signal(signum, _raise_stopped)
    try:
        yield
    except _Stopped as stopped:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        previous.clear()
        os.kill(os.getpid(), stopped.signum)   # the default action: the process ends
        raise BuildError(f"interrupted by {signal.Signals(stopped.signum).name}") from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _raise_stopped(signum, _frame):
    raise _Stopped(signum)


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
            f"{tf_info['version']} into {target_dir} (once; about half a minute)...")
        start = time.time()
        _remove_abandoned_builds(target_dir)
        with stops_cleanly():
            tmp = tempfile.mkdtemp(dir=target_dir, prefix=BUILD_DIR_PREFIX)
            try:
                partial = os.path.join(tmp, LIBRARY_NAME)
                run_commands(compile_commands(tf_info, package_dir, tmp, partial, core_lib_dir,
                                              cxx))
                os.replace(partial, target)  # atomic: readers never see half a library
            finally:
                with signals_deferred():
                    shutil.rmtree(tmp, ignore_errors=True)
        write_stamp(target, key, tf_info["version"])
        log(f"bps_tf: op library ready ({time.time() - start:.0f} s).")
    return target


def _remove_abandoned_builds(target_dir: str) -> None:
    """Temporary folders of builds whose process died (SIGKILL, a power
    cut): only the holder of the lock builds, so under it none is alive."""
    for entry in os.listdir(target_dir):
        if entry.startswith(BUILD_DIR_PREFIX):
            shutil.rmtree(os.path.join(target_dir, entry), ignore_errors=True)


def main(argv=None) -> None:
    """`python -m bps_tf.op_build`: build (or find) the op library now, e.g. in
    a container image, so that no worker compiles it at start-up.
    `--stamp PATH`: mark an op library built by other means (Bazel) against
    this environment's TensorFlow as built for it."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m bps_tf.op_build")
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
