"""The GPU path: CUDA reduce kernels, their harness, and the build decision.

* With nvcc (even without a GPU): the kernels compile, and their per-thread
  code, run on the CPU by the emulation build, matches numpy.
* With a CUDA GPU: tests/gpu/harness.py runs the real kernels (short sizes).
* Always: the decision whether setup.py builds the TF GPU kernel.
"""
import importlib.util
import io
import os
import subprocess
import sys
from contextlib import redirect_stdout

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import build_gpu  # noqa: E402


def _load_harness():
    spec = importlib.util.spec_from_file_location(
        "bps_gpu_harness", os.path.join(ROOT, "tests", "gpu", "harness.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


harness = _load_harness()
NVCC = build_gpu.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (no CUDA toolkit)")
# Fewer and smaller sizes than the harness's default: the emulation runs on the CPU.
EMULATION_SIZES = [0, 1, 2, 3, 7, 31, 4097, 65_539]


@pytest.fixture(scope="module")
def emulation_lib(tmp_path_factory):
    """The kernels compiled by nvcc for one arch (sm_80), plus the CPU-emulation
    entry points: one compile serves as the build check and the CPU check."""
    out = str(tmp_path_factory.mktemp("gpu") / "libbps_gpu_reduce_emu.so")
    path, secs = build_gpu.build_reduce_library(out, archs="80", emulation=True, ptx=False,
                                                quiet=True)
    print(f"nvcc built {os.path.basename(path)} (sm_80) in {secs:.1f} s")
    return path


@needs_nvcc
def test_kernels_compile_with_nvcc(emulation_lib):
    assert os.path.getsize(emulation_lib) > 0
    # cudart is linked statically: the library must not need a libcudart.
    deps = subprocess.run(["ldd", emulation_lib], capture_output=True, text=True).stdout
    assert "libcudart" not in deps, deps


@needs_nvcc
@pytest.mark.parametrize("dtype", list(harness.DTYPES))
def test_emulated_kernels_match_numpy(emulation_lib, dtype):
    kernels = harness.Kernels(emulation_lib, prefix="bps_host")
    with np.errstate(over="ignore"):
        result = harness.run_checks(kernels, harness.HostBuffers(), EMULATION_SIZES, [dtype])
    assert result["failures"] == [], f"seed {result['seed']}: {result['failures'][:10]}"
    assert result["checked"] > 100


@needs_nvcc
def test_bad_arguments_are_refused_with_a_message(emulation_lib):
    kernels = harness.Kernels(emulation_lib, prefix="bps_host")
    checker = harness.Checker(kernels, harness.HostBuffers(), np.random.default_rng(0))
    harness.check_errors(checker)
    assert checker.failures == []


def test_harness_on_gpu(tmp_path):
    if harness.cuda_device_count() == 0:
        pytest.skip("no CUDA GPU on this machine")
    if NVCC is None:
        pytest.skip("nvcc not found (no CUDA toolkit)")
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "gpu", "harness.py"), "--build",
         "--lib", str(tmp_path / "libbps_gpu_reduce.so"), "--sizes", "0,1,3,31,4097,65539",
         "--bench-mib", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    if proc.returncode == 2:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert out.exists()


# ---- the decision to build the TF GPU kernel ----

def test_plan_for_this_machines_tensorflow():
    """tensorflow-cpu (the test install) and a machine without TensorFlow (a GPU
    box checking the kernels) both skip the TF GPU kernel, saying why."""
    info = build_gpu.tf_build_info()
    ok, reason = build_gpu.gpu_build_plan(info)
    if not info["found"]:
        assert not ok and "TensorFlow is not installed" in reason
    elif info.get("is_cuda_build") is False:
        assert not ok and "is not a CUDA build" in reason
    else:  # a CUDA TensorFlow: then only nvcc can stand in the way
        assert ok or "nvcc" in reason, reason


def test_plan_builds_with_cuda_tensorflow_and_a_matching_nvcc():
    cuda_tf = {"is_cuda_build": True, "cuda_version": "12.5.1"}
    ok, reason = build_gpu.gpu_build_plan(cuda_tf, nvcc="/opt/cuda/bin/nvcc", nvcc_ver=(12, 4))
    assert ok, reason
    ok, reason = build_gpu.gpu_build_plan(cuda_tf, nvcc="/opt/cuda/bin/nvcc", nvcc_ver=(13, 0))
    assert not ok and "needs CUDA 12" in reason
    ok, reason = build_gpu.gpu_build_plan(cuda_tf, nvcc="")
    assert not ok and "nvcc not found" in reason
    ok, reason = build_gpu.gpu_build_plan({"is_cuda_build": False, "version": "2.21.0"},
                                          nvcc="/opt/cuda/bin/nvcc", nvcc_ver=(12, 4))
    assert not ok and "TensorFlow 2.21.0 is not a CUDA build" in reason


def test_setup_hook_prints_one_line_when_skipping(tmp_path):
    buf = io.StringIO()
    with redirect_stdout(buf):
        built = build_gpu.add_gpu_kernels_to_op_library(
            {"version": "2.21.0", "cflags": [], "lflags": []}, ["g++"], str(tmp_path),
            str(tmp_path / "never_written.so"), [], [])
    lines = buf.getvalue().splitlines()
    assert not built
    assert len(lines) == 1 and lines[0].startswith("bps_tf: GPU kernel skipped: "), lines
    assert not (tmp_path / "never_written.so").exists()
