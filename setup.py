"""Builds bps_tf: the C++ core, its pybind11 module and the TensorFlow op library.

The op library must be compiled against the exact TensorFlow that will load
it (its C++ ABI changes every release), so install with
`pip install --no-build-isolation .` into an environment that already has
TensorFlow: an isolated build would compile against whatever TensorFlow the
build environment happened to fetch.
"""
import json
import os
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
MIN_TF = (2, 16)
CORE_SOURCES = ["api.cc", "auth.cc", "common.cc", "protocol.cc", "reduce.cc", "scheduler.cc",
                "server_node.cc", "stats.cc", "sum_engine.cc", "trace.cc", "transport.cc",
                "worker_engine.cc"]
OP_SOURCES = ["bps_tf/ops/push_pull_ops.cc", "bps_tf/ops/priority_pass.cc",
              "bps_tf/ops/priority_pass_stats.cc", "bps_tf/ops/graph_rewrite.cc",
              "bps_tf/ops/sparse_gather.cc", "bps_tf/kernels/push_pull_kernels.cc"]
WARNINGS = ["-Wall", "-Wno-sign-compare"]


def _tensorflow_flags():
    probe = (
        "import json, tensorflow as tf\n"
        "print(json.dumps({'version': tf.__version__,"
        " 'cflags': tf.sysconfig.get_compile_flags(),"
        " 'lflags': tf.sysconfig.get_link_flags()}))\n")
    try:
        out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                             text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")).stdout
    except subprocess.CalledProcessError as exc:
        sys.exit(
            "bps_tf build error: TensorFlow cannot be imported by " + sys.executable + ".\n"
            "Install it first (e.g. `pip install tensorflow-cpu`), then build without isolation:"
            " `pip install --no-build-isolation .`\n" + exc.stderr[-2000:])
    info = json.loads(out.strip().splitlines()[-1])
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


class BuildNative(build_ext):
    """Compiles with g++ directly: three targets, no distutils compiler model."""

    def run(self):
        import pybind11

        out_root = HERE if self.inplace else os.path.abspath(self.build_lib)
        tmp = os.path.abspath(self.build_temp)
        os.makedirs(tmp, exist_ok=True)
        pkg = os.path.join(out_root, "bps_tf")
        os.makedirs(os.path.join(pkg, "ops"), exist_ok=True)
        core_dir = os.path.join(HERE, "bps_tf", "core")
        headers = [os.path.join(core_dir, f) for f in os.listdir(core_dir) if f.endswith(".h")]
        cxx = os.environ.get("CXX", "g++")
        base = [cxx, "-std=c++17", "-O3", "-fPIC", "-pthread", "-DNDEBUG"] + WARNINGS
        tf = _tensorflow_flags()
        tf_cflags = [f for f in tf["cflags"] if not f.startswith("--std")]

        def compile_obj(src, obj, extra):
            if _newer(obj, [src] + headers):
                _run(base + extra + ["-c", src, "-o", obj])
            return obj

        jobs = []
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            # Op library objects first: they take the longest (TF headers).
            for src in OP_SOURCES:
                obj = os.path.join(tmp, os.path.basename(src) + ".o")
                jobs.append(("op", pool.submit(compile_obj, os.path.join(HERE, src), obj,
                                               tf_cflags + ["-I" + core_dir,
                                                            "-Wno-deprecated-declarations",
                                                            "-Wno-interference-size"])))
            for src in CORE_SOURCES:
                obj = os.path.join(tmp, "core_" + src + ".o")
                jobs.append(("core", pool.submit(compile_obj, os.path.join(core_dir, src),
                                                 obj, [])))
            pyb = os.path.join(tmp, "pybind_module.o")
            jobs.append(("py", pool.submit(
                compile_obj, os.path.join(core_dir, "pybind_module.cc"), pyb,
                ["-I" + pybind11.get_include(), "-I" + sysconfig.get_paths()["include"],
                 "-fvisibility=hidden"])))
            objs = {"op": [], "core": [], "py": []}
            for kind, fut in jobs:
                objs[kind].append(fut.result())

        core_lib = os.path.join(pkg, "libbps_core.so")
        if _newer(core_lib, objs["core"]):
            # libzmq is deliberately not linked: bps_tf/_loader.py supplies it.
            _run(base + ["-shared", "-Wl,-soname,libbps_core.so", "-o", core_lib]
                 + objs["core"])
        ext = sysconfig.get_config_var("EXT_SUFFIX")
        py_mod = os.path.join(pkg, "_core" + ext)
        if _newer(py_mod, objs["py"] + [core_lib]):
            _run(base + ["-shared", "-o", py_mod] + objs["py"]
                 + ["-L" + pkg, "-lbps_core", "-Wl,-rpath,$ORIGIN"])
        op_lib = os.path.join(pkg, "ops", "libbps_tf_ops.so")
        op_link = ["-L" + pkg, "-lbps_core", "-Wl,-rpath,$ORIGIN/.."] + tf["lflags"]
        if _newer(op_lib, objs["op"] + [core_lib]):
            _run(base + ["-shared", "-o", op_lib] + objs["op"] + op_link)
        sys.path.insert(0, os.path.join(HERE, "tools"))
        from build_gpu import add_gpu_kernels_to_op_library  # one line saying why, if skipped
        add_gpu_kernels_to_op_library(tf, base, tmp, op_lib, objs["op"], op_link)


setup(
    name="bps_tf",
    version="0.1.0",
    description="BytePS-style distributed training for TensorFlow and Keras",
    packages=find_packages(include=["bps_tf", "bps_tf.*"]),
    python_requires=">=3.9",
    install_requires=["numpy", "pyzmq>=22"],
    ext_modules=[Extension("bps_tf._core", sources=[])],  # built by BuildNative
    cmdclass={"build_ext": BuildNative},
    entry_points={"console_scripts": ["bpslaunch = bps_tf.launcher:main"]},
    zip_safe=False,
)
