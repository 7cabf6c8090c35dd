"""Builds bps_tf: the C++ core, its pybind11 module and the TensorFlow op library.

`pip install .` works with pip's default build isolation: the core and the
pybind11 module need no TensorFlow (pyproject.toml declares their build
requirements). The op library must be compiled against the exact TensorFlow
that loads it (its C++ ABI changes every release), so it is built here only
when the building Python can import TensorFlow (`pip install
--no-build-isolation .`), and stamped with that TensorFlow's key; otherwise,
or after a TensorFlow upgrade, bps_tf compiles it at first import into a
per-user cache (bps_tf/ops/op_build.py). A stale build is never loaded.
"""
import importlib.util
import os
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
MIN_TF = (2, 16)
# Paths under bps_tf/core, which is also the include root (`#include "worker/trace.h"`).
CORE_SOURCES = ["api.cc",
                "common/common.cc", "common/labels.cc", "common/limits.cc", "common/stats.cc",
                "math/compressor.cc", "math/reduce.cc",
                "scheduler/membership.cc", "scheduler/scheduler.cc", "scheduler/scheduler_declare.cc",
                "scheduler/scheduler_elastic.cc", "scheduler/scheduler_control.cc",
                "scheduler/launcher_link.cc", "scheduler/scheduler_recover.cc",
                "scheduler/scheduler_servers.cc", "scheduler/scheduler_welcome.cc",
                "server/reply_scheduler.cc", "server/server_control.cc", "server/server_node.cc",
                "server/sum_compressed.cc",
                "server/sum_engine.cc",
                "transport/aead_suites.cc", "transport/channel.cc", "transport/channel_check.cc",
                "transport/channel_link.cc", "transport/cipher_pool.cc",
                "transport/curve_check.cc", "transport/fusion.cc",
                "transport/link_cipher.cc",
                "transport/local_links.cc", "transport/protocol.cc", "transport/sealed_links.cc",
                "transport/security.cc", "transport/sodium_api.cc", "transport/transport.cc",
                "worker/local_reduce.cc", "worker/local_reduce_gather.cc",
                "worker/local_reduce_link.cc", "worker/trace.cc",
                "worker/worker_engine.cc", "worker/worker_enqueue.cc", "worker/worker_io.cc",
                "worker/worker_queue.cc"]
WARNINGS = ["-Wall", "-Wno-sign-compare"]
# A source included by a unit is no longer the main file, so GCC would warn
# about its classes that hold a type of its anonymous namespace.
UNIT_WARNINGS = ["-Wno-subobject-linkage"]


def core_units():
    """CORE_SOURCES by folder: each folder compiles as one unit, a generated
    file that includes its sources. The standard headers every source
    includes cost the compiler ~2 s per unit, most of a small source's
    compile: 42 units took 140 core-s, seven take ~55 (~30 s on 2 cores), and a
    change recompiles one folder, not the engine."""
    units = {}
    for src in CORE_SOURCES:
        units.setdefault(os.path.dirname(src) or "api", []).append(src)
    return units


def _load_op_build():
    # By path: importing the bps_tf package here would need its native parts.
    spec = importlib.util.spec_from_file_location(
        "bps_tf_op_build", os.path.join(HERE, "bps_tf", "ops", "op_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


op_build = _load_op_build()
OP_SOURCES = ["bps_tf/" + s for s in op_build.OP_SOURCES]


def _tensorflow_flags():
    """TensorFlow's build flags, or None when this Python has no TensorFlow."""
    try:
        info = op_build.tensorflow_info_of(sys.executable)
    except subprocess.CalledProcessError:
        print("bps_tf: TensorFlow is not importable in the build environment: the op library "
              "will be compiled at first import, against the TensorFlow that loads it.",
              flush=True)
        return None
    version = tuple(int(x) for x in info["version"].split(".")[:2])
    if version < MIN_TF:
        sys.exit(f"bps_tf build error: TensorFlow {info['version']} is too old; "
                 f"bps_tf needs TensorFlow >= {'.'.join(map(str, MIN_TF))}.")
    return info


def _newer(target, sources):
    if not os.path.exists(target):
        return True
    t = os.path.getmtime(target)
    return any(os.path.getmtime(s) > t for s in sources)


def _run(cmd):
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _announce(line):
    """One line before the long compile. pip keeps a build's output to
    itself (shown with -v, or on failure) and says only "Building wheel for
    bps_tf (pyproject.toml): still running...", so the line also goes to the
    user's terminal, when there is one."""
    print(line, flush=True)
    if sys.stdout.isatty():
        return
    try:
        with open("/dev/tty", "w") as tty:
            tty.write("\n" + line + "\n")
    except OSError:
        pass              # no terminal (CI, a container without one): the log has it


class BuildNative(build_ext):
    """Compiles with g++ directly: three targets, no distutils compiler model."""

    def run(self):
        try:
            import pybind11
        except ImportError:
            sys.exit("bps_tf build error: pybind11 is missing. `pip install .` installs it in "
                     "its isolated build environment; with --no-build-isolation run "
                     "`pip install pybind11` first.")

        out_root = HERE if self.inplace else os.path.abspath(self.build_lib)
        tmp = os.path.abspath(self.build_temp)
        os.makedirs(tmp, exist_ok=True)
        pkg = os.path.join(out_root, "bps_tf")
        os.makedirs(os.path.join(pkg, "ops"), exist_ok=True)
        core_dir = os.path.join(HERE, "bps_tf", "core")
        headers = [os.path.join(root, f) for root, _, files in os.walk(core_dir)
                   for f in files if f.endswith(".h")]
        cxx = op_build.compiler()
        base = [cxx, "-std=c++17", "-O3", "-fPIC", "-pthread", "-DNDEBUG"] + WARNINGS
        core_include = ["-I" + core_dir]

        def compile_obj(src, obj, extra, inputs):
            if _newer(obj, [src] + inputs + headers):
                _run(base + extra + ["-c", src, "-o", obj])
            return obj

        units = []    # (unit source, its object, the sources it includes)
        for folder, srcs in core_units().items():
            unit = op_build.write_unit(os.path.join(tmp, f"core_unit_{folder}.cc"), srcs)
            units.append((unit, unit[:-len(".cc")] + ".o",
                          [os.path.join(core_dir, s) for s in srcs]))
        py_src = os.path.join(core_dir, "pybind_module.cc")
        py_obj = os.path.join(tmp, "pybind_module.o")
        stale = [unit for unit, obj, srcs in units if _newer(obj, [unit] + srcs + headers)]
        if stale or _newer(py_obj, [py_src] + headers):
            took = " (about a minute on 2 cores)" if len(stale) > len(units) // 2 else ""
            _announce(f"bps_tf: compiling its C++ engine ({len(stale)} of {len(units)} parts) and "
                      f"Python module with {cxx}{took}...")
        jobs = []
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            for unit, obj, srcs in units:
                jobs.append(("core", pool.submit(compile_obj, unit, obj,
                                                 core_include + UNIT_WARNINGS, srcs)))
            jobs.append(("py", pool.submit(
                compile_obj, py_src, py_obj,
                core_include + ["-I" + pybind11.get_include(),
                                "-I" + sysconfig.get_paths()["include"], "-fvisibility=hidden"],
                [])))
            objs = {"core": [], "py": []}
            for kind, fut in jobs:
                objs[kind].append(fut.result())

        core_lib = os.path.join(pkg, "libbps_core.so")
        if _newer(core_lib, objs["core"]):
            # libzmq and libsodium are deliberately not linked:
            # bps_tf/runtime/loader.py supplies them (libdl finds libsodium's
            # functions in it; a stub inside libc since glibc 2.34).
            _run(base + ["-shared", "-Wl,-soname,libbps_core.so", "-o", core_lib]
                 + objs["core"] + ["-ldl"])
        ext = sysconfig.get_config_var("EXT_SUFFIX")
        py_mod = os.path.join(pkg, "_core" + ext)
        if _newer(py_mod, objs["py"] + [core_lib]):
            _run(base + ["-shared", "-o", py_mod] + objs["py"]
                 + ["-L" + pkg, "-lbps_core", "-Wl,-rpath,$ORIGIN"])
        tf = _tensorflow_flags()
        if tf is not None:
            self._build_op_library(tf, pkg, tmp, base)
        else:
            # A library left in build/ by an earlier build was made for some
            # other TensorFlow: never ship it.
            for leftover in (op_build.LIBRARY_NAME, op_build.LIBRARY_NAME + op_build.STAMP_SUFFIX):
                path = os.path.join(pkg, "ops", leftover)
                if os.path.exists(path):
                    os.remove(path)

    def _build_op_library(self, tf, pkg, tmp, base):
        src_pkg = os.path.join(HERE, "bps_tf")
        key = op_build.build_key(tf, src_pkg)
        op_lib = os.path.join(pkg, "ops", op_build.LIBRARY_NAME)
        if op_build.read_stamp(op_lib).get("key") == key and os.path.exists(op_lib):
            return
        # Objects live under the key: a TensorFlow upgrade never reuses them.
        obj_dir = os.path.join(tmp, "ops-" + key)
        os.makedirs(obj_dir, exist_ok=True)
        cmds = op_build.compile_commands(tf, src_pkg, obj_dir, op_lib, pkg)
        # The installed op library finds the core beside it, wherever it lands.
        cmds[-1] = [a.replace("-Wl,-rpath," + pkg, "-Wl,-rpath,$ORIGIN/..") for a in cmds[-1]]
        op_build.run_commands(cmds, echo=lambda line: print(line, flush=True))
        sys.path.insert(0, os.path.join(HERE, "tools"))
        from build_gpu import add_gpu_kernels_to_op_library  # one line saying why, if skipped
        op_objs = [c[c.index("-o") + 1] for c in cmds[:-1]]
        link = op_build.link_flags(tf, pkg)
        link = [a.replace("-Wl,-rpath," + pkg, "-Wl,-rpath,$ORIGIN/..") for a in link]
        add_gpu_kernels_to_op_library(tf, base, obj_dir, op_lib, op_objs, link)
        op_build.write_stamp(op_lib, key, tf["version"])


setup(
    name="bps_tf",
    version="0.1.0",
    description="BytePS-style distributed training for TensorFlow and Keras",
    packages=find_packages(include=["bps_tf", "bps_tf.*"]),
    # The op library's sources ship with the package: it is compiled where it
    # is used when the installed build does not match the TensorFlow there.
    # Every core header ships (the op library includes only bps_api.h and
    # dtypes.h; the rest documents the engine the installed library runs).
    package_data={"bps_tf": ["core/*.h", "core/*/*.h", "ops/*.cc", "ops/*.h", "kernels/*.cc",
                             "kernels/*.h"]},
    python_requires=">=3.9",
    # grpcio serves the Kubernetes health probes (BYTEPS_HEALTH_PORT); imported only then.
    install_requires=["numpy", "pyzmq>=22", "grpcio", "grpcio-health-checking"],
    ext_modules=[Extension("bps_tf._core", sources=[])],  # built by BuildNative
    cmdclass={"build_ext": BuildNative},
    entry_points={"console_scripts": ["bpslaunch = bps_tf.launch.launcher:main"]},
    zip_safe=False,
)
