"""Builds bps_tf's GPU pieces and decides whether the TF GPU kernel can be built.

Two products:
  * libbps_gpu_reduce.so: the TF-free CUDA kernels (bps_tf/core/gpu/gpu_reduce.cu)
    behind their C ABI, for the ctypes harness in tests/gpu/. Needs only nvcc.
  * the GPU kernel of the TF op library (bps_tf/kernels/push_pull_gpu_kernels.cc
    plus the same kernels), linked into libbps_tf_ops.so by setup.py. Needs a
    CUDA build of TensorFlow and an nvcc of the same CUDA major version.

    python tools/build_gpu.py                   # builds build/gpu/libbps_gpu_reduce.so
    python tools/build_gpu.py --plan            # prints the TF GPU kernel decision
    python tools/build_gpu.py --check-tf-kernel # compiles the TF GPU kernel here, even
                                                # against tensorflow-cpu (syntax check)

cudart is linked statically, so the products do not need a libcudart of the
toolkit's version at run time (only a driver new enough for the toolkit).
"""
import argparse
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(REPO, "bps_tf", "kernels")
CORE = os.path.join(REPO, "bps_tf", "core")
# Framework-free, so part of the core (includes are paths under bps_tf/core).
REDUCE_DIR = os.path.join(CORE, "gpu")
REDUCE_SRC = os.path.join(REDUCE_DIR, "gpu_reduce.cu")
TF_KERNEL_SRC = os.path.join(KERNELS, "push_pull_gpu_kernels.cc")
DEFAULT_LIB = os.path.join(REPO, "build", "gpu", "libbps_gpu_reduce.so")
# Ampere and Hopper machine code, plus PTX of the newest so later GPUs can JIT it.
DEFAULT_ARCHS = ("80", "90")
ARCHS_ENV = "BPS_TF_CUDA_ARCHS"  # e.g. "80,90" or "90"
TF_CUDA_MAJOR_DEFAULT = 12  # TF 2.16-2.21 CUDA wheels are built with CUDA 12


def _log(msg):
    print(msg, flush=True)


# ---- toolkit discovery ----

def find_nvcc():
    """Path of nvcc: $CUDA_HOME / $CUDA_PATH first, then PATH, then /usr/local/cuda."""
    for env in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(env)
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    fallback = "/usr/local/cuda/bin/nvcc"
    return fallback if os.access(fallback, os.X_OK) else None


def nvcc_version(nvcc):
    """(major, minor) from `nvcc --version`, or None."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def cuda_root(nvcc):
    """The toolkit directory holding include/ and lib64/ for this nvcc. nvcc may
    be a wrapper script elsewhere (e.g. /usr/local/bin), so ask nvcc itself."""
    guess = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if os.path.exists(os.path.join(guess, "include", "cuda_runtime_api.h")):
        return guess
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60).stderr
        m = re.search(r"^#\$ TOP=(.+)$", out, re.M)
        if m:
            return os.path.normpath(m.group(1).strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return guess


def cuda_archs(archs=None):
    if archs is None:
        archs = os.environ.get(ARCHS_ENV) or ",".join(DEFAULT_ARCHS)
    if isinstance(archs, str):
        archs = [a for a in re.split(r"[,; ]+", archs) if a]
    return [a.replace("sm_", "").replace(".", "") for a in archs]


def gencode_flags(archs):
    """-gencode for each arch's machine code, and PTX of the newest one."""
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    newest = max(archs, key=int)
    return flags + ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]


def nvcc_base(nvcc, archs, ptx=True):
    gen = gencode_flags(archs) if ptx else [
        x for a in archs for x in ("-gencode", f"arch=compute_{a},code=sm_{a}")]
    return [nvcc, "-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-DNDEBUG"] + gen


def _run(cmd, quiet=False):
    if not quiet:
        _log(" ".join(cmd))
    start = time.monotonic()
    subprocess.run(cmd, check=True)
    return time.monotonic() - start


# ---- the standalone reduce library ----

def build_reduce_library(out=DEFAULT_LIB, archs=None, emulation=False, nvcc=None, ptx=True,
                         quiet=False):
    """Compiles gpu_reduce.cu into a shared library with cudart linked statically.

    emulation=True adds the bps_host_* twins that run the kernels' per-thread
    code on the CPU (tests use them where there is no GPU). Returns
    (path, seconds).
    """
    nvcc = nvcc or find_nvcc()
    if not nvcc:
        raise RuntimeError("nvcc not found: install a CUDA toolkit or set CUDA_HOME")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    cmd = nvcc_base(nvcc, cuda_archs(archs), ptx=ptx) + [
        "-shared", "--cudart", "static", "-I" + CORE, REDUCE_SRC, "-o", out]
    if emulation:
        cmd.insert(1, "-DBPS_GPU_HOST_EMULATION")
    return out, _run(cmd, quiet=quiet)


# ---- the TF GPU kernel: should we build it? ----

def tf_build_info():
    """TensorFlow's build_info without importing TensorFlow (a plain module file)."""
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        return {"found": False}
    root = list(spec.submodule_search_locations)[0]
    path = os.path.join(root, "python", "platform", "build_info.py")
    info = {"found": True, "include": os.path.join(root, "include")}
    for dist in ("tensorflow", "tensorflow-cpu", "tf-nightly", "tensorflow-gpu"):
        try:
            info.update(version=importlib.metadata.version(dist), dist=dist)
            break
        except importlib.metadata.PackageNotFoundError:
            pass
    if os.path.exists(path):
        mod_spec = importlib.util.spec_from_file_location("_bps_tf_build_info", path)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
        info.update(dict(getattr(mod, "build_info", {})))
    return info


def gpu_build_plan(tf_info, nvcc=None, nvcc_ver=None):
    """(build?, reason): the TF GPU kernel needs a CUDA build of TensorFlow and an
    nvcc of the CUDA major version TensorFlow was built with (12 for TF 2.16-2.21).

    nvcc/nvcc_ver are looked up when not given; tests pass them in.
    """
    if nvcc is None:
        nvcc = find_nvcc()
    if nvcc and nvcc_ver is None:
        nvcc_ver = nvcc_version(nvcc)
    cuda_version = str(tf_info.get("cuda_version") or "")
    want_major = int(cuda_version.split(".")[0]) if cuda_version[:1].isdigit() \
        else TF_CUDA_MAJOR_DEFAULT
    problems = []
    if not tf_info.get("found", True):
        problems.append("TensorFlow is not installed")
    elif not tf_info.get("is_cuda_build"):
        dist = tf_info.get("dist")
        label = " ".join(filter(None, ["TensorFlow", tf_info.get("version"),
                                       f"({dist})" if dist else None]))
        problems.append(f"{label} is not a CUDA build; install the `tensorflow` wheel")
    if not nvcc:
        problems.append("nvcc not found (install a CUDA toolkit or set CUDA_HOME)")
    elif not nvcc_ver:
        problems.append(f"cannot read the version of {nvcc}")
    elif nvcc_ver[0] != want_major:
        problems.append(f"nvcc is CUDA {nvcc_ver[0]}.{nvcc_ver[1]} but TensorFlow needs "
                        f"CUDA {want_major} (set CUDA_HOME to a CUDA {want_major} toolkit)")
    if problems:
        return False, "; ".join(problems)
    return True, (f"CUDA TensorFlow (CUDA {cuda_version or want_major}) and nvcc "
                  f"{nvcc_ver[0]}.{nvcc_ver[1]} at {nvcc}")


def _cuda_include_flags(nvcc, tf_include, tmp):
    """-I flags for the TF GPU kernel. TF's headers include CUDA through
    third_party/gpus/cuda/include; the CUDA wheel ships those, tensorflow-cpu
    does not, so a link to the toolkit stands in for them when missing."""
    inc = os.path.join(cuda_root(nvcc), "include")
    flags = ["-I" + inc]
    if tf_include and not os.path.exists(
            os.path.join(tf_include, "third_party", "gpus", "cuda", "include", "cuda.h")):
        shim = os.path.join(tmp, "cuda_shim")
        link = os.path.join(shim, "third_party", "gpus", "cuda", "include")
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if not os.path.islink(link):
            os.symlink(inc, link)
        flags.append("-I" + shim)
    return flags


def _stale(obj, sources, force):
    if force or not os.path.exists(obj):
        return True
    return any(os.path.getmtime(s) > os.path.getmtime(obj) for s in sources)


def compile_tf_gpu_objects(nvcc, base, tf_cflags, tf_include, tmp, archs=None, force=False):
    """Objects for the op library: the kernels (nvcc) and the TF GPU kernel (g++),
    each recompiled only when its sources changed (unless force).
    Returns (objects, link flags)."""
    core_dir = CORE
    header = os.path.join(REDUCE_DIR, "gpu_reduce.h")
    reduce_obj = os.path.join(tmp, "gpu_reduce.cu.o")
    if _stale(reduce_obj, [REDUCE_SRC, header, os.path.join(REDUCE_DIR, "gpu_reduce_ops.cuh")],
              force):
        _run(nvcc_base(nvcc, cuda_archs(archs)) + ["-I" + CORE, "-c", REDUCE_SRC, "-o",
                                                   reduce_obj])
    kernel_obj = os.path.join(tmp, "push_pull_gpu_kernels.cc.o")
    core_headers = [os.path.join(core_dir, h) for h in ("bps_api.h", "dtypes.h")]
    abi = os.path.join(KERNELS, "core_abi.h")
    if _stale(kernel_obj, [TF_KERNEL_SRC, header, abi] + core_headers, force):
        _run(base + tf_cflags + _cuda_include_flags(nvcc, tf_include, tmp)
             + ["-DGOOGLE_CUDA=1", "-DEIGEN_USE_GPU", "-I" + core_dir, "-I" + KERNELS,
                "-Wno-deprecated-declarations", "-Wno-interference-size",
                "-c", TF_KERNEL_SRC, "-o", kernel_obj])
    lib64 = os.path.join(cuda_root(nvcc), "lib64")
    if not os.path.isdir(lib64):
        lib64 = os.path.join(cuda_root(nvcc), "lib")
    return [reduce_obj, kernel_obj], ["-L" + lib64, "-l:libcudart_static.a", "-ldl", "-lrt"]


def add_gpu_kernels_to_op_library(tf, base, tmp, op_lib, op_objs, link_args):
    """setup.py's hook, after the CPU op library is linked: when the plan allows,
    compiles the GPU kernel and links the op library again with it; otherwise
    prints one line saying why it was skipped. Returns True if built."""
    info = tf_build_info()
    info["version"] = tf.get("version") or info.get("version")
    ok, reason = gpu_build_plan(info)
    if not ok:
        _log("bps_tf: GPU kernel skipped: " + reason)
        return False
    nvcc = find_nvcc()
    tf_cflags = [f for f in tf["cflags"] if not f.startswith("--std")]
    objs, cuda_link = compile_tf_gpu_objects(nvcc, base, tf_cflags, info.get("include"), tmp)
    _run(base + ["-shared", "-o", op_lib] + op_objs + objs + link_args + cuda_link)
    _log("bps_tf: GPU kernel built: " + reason)
    return True


def check_tf_kernel(tmp):
    """Compiles (never links) the TF GPU kernel with whatever TensorFlow and nvcc
    are here, ignoring the plan: a syntax and API check on CPU-only machines."""
    import json
    probe = ("import json, tensorflow as tf; print(json.dumps("
             "{'cflags': tf.sysconfig.get_compile_flags()}))")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                         text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")).stdout
    cflags = [f for f in json.loads(out.strip().splitlines()[-1])["cflags"]
              if not f.startswith("--std")]
    nvcc = find_nvcc()
    if not nvcc:
        raise RuntimeError("nvcc not found")
    os.makedirs(tmp, exist_ok=True)
    base = [os.environ.get("CXX", "g++"), "-std=c++17", "-O2", "-fPIC", "-DNDEBUG", "-Wall",
            "-Wno-sign-compare"]
    start = time.monotonic()
    objs, _ = compile_tf_gpu_objects(nvcc, base, cflags, tf_build_info().get("include"), tmp,
                                     force=True)
    return objs, time.monotonic() - start


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_LIB, help="path of libbps_gpu_reduce.so")
    ap.add_argument("--archs", default=None,
                    help=f"compute capabilities, e.g. 80,90 (default: ${ARCHS_ENV} or 80,90)")
    ap.add_argument("--emulation", action="store_true",
                    help="also export the CPU-emulation entry points (tests)")
    ap.add_argument("--plan", action="store_true", help="print the TF GPU kernel decision")
    ap.add_argument("--check-tf-kernel", action="store_true",
                    help="compile the TF GPU kernel here regardless of the plan")
    args = ap.parse_args(argv)
    if args.plan:
        ok, reason = gpu_build_plan(tf_build_info())
        _log(("build: " if ok else "skip: ") + reason)
        return 0
    if args.check_tf_kernel:
        objs, secs = check_tf_kernel(os.path.join(REPO, "build", "gpu", "tf_kernel_check"))
        _log(f"compiled {', '.join(os.path.basename(o) for o in objs)} in {secs:.1f} s")
        return 0
    path, secs = build_reduce_library(args.out, args.archs, emulation=args.emulation)
    _log(f"built {path} in {secs:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
