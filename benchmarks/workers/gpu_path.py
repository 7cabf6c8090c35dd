"""bps_tf worker on a GPU, without TensorFlow: the data path of the TF GPU kernel.

Usage: gpu_path.py SPEC.json (written by benchmarks/gpu_path.py).

Each push_pull takes the steps of push_pull_gpu_kernels.cc, on one CUDA stream:
two device inputs summed by bps_gpu_sum (the op's local reduce), a copy into a
pinned host buffer, the engine's push_pull of that buffer in place, the copy
back to the device. Pinned buffers are allocated once per size and reused, as
TensorFlow's host allocator reuses them.

* checks: every float dtype, sizes from 0 to 3 partitions, integer-valued data
  whose sum is exact in every dtype; the device result is compared bit for bit.
* timing: per size, the phases of the GPU path (reduce, device->host, push_pull,
  host->device) and, interleaved with it, the CPU path (push_pull of pageable
  host memory): the baseline measured in the same run.

With "emulate" in the spec, device buffers are host memory and the kernels run
through their CPU emulation build, so the script can be tried without a GPU.
"""
import ctypes
import json
import os
import statistics
import sys
import time

import numpy as np

import bps_tf  # noqa: E402
from bps_tf.runtime import basics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "gpu"))
import harness  # noqa: E402  (the kernels' ctypes wrapper and device buffers)

HOST_DTYPES = {"float16": np.float16, "float32": np.float32, "float64": np.float64}


def host_dtype(name):
    if name == "bfloat16":
        import ml_dtypes  # numpy has no bfloat16; the core takes ml_dtypes' arrays
        return ml_dtypes.bfloat16
    return HOST_DTYPES[name]


class Device:
    """Device buffers, pinned host buffers and the stream: CuPy, or host memory
    standing in for both when emulating."""

    def __init__(self, emulate):
        self.emulate = emulate
        if emulate:
            self.bufs = harness.HostBuffers()
            self.name = "CPU emulation"
        else:
            import cupy
            import cupyx
            self.cp, self.cupyx = cupy, cupyx
            self.bufs = harness.CupyBuffers()
            self.name = self.bufs.device

    def empty(self, nbytes):
        return self.bufs.empty(nbytes)

    def pinned(self, nbytes):
        if self.emulate:
            return np.empty(max(nbytes, 1), dtype=np.uint8)
        return self.cupyx.empty_pinned((max(nbytes, 1),), dtype=np.uint8)

    def ptr(self, buf):
        return self.bufs.ptr(buf)

    def put(self, buf, data):
        self.bufs.put(buf, 0, data.view(np.uint8).ravel())

    def get(self, buf, nbytes):
        return self.bufs.get(buf, 0, nbytes)

    def copy_async(self, dst_ptr, src_ptr, nbytes, kind):
        """kind 1: host to device, 2: device to host (cudaMemcpyKind)."""
        if nbytes == 0:
            return
        if self.emulate:
            ctypes.memmove(dst_ptr, src_ptr, nbytes)
        else:
            self.cp.cuda.runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, kind, self.bufs.stream)

    def sync(self):
        self.bufs.sync()


class GpuPushPull:
    """One tensor's buffers on the GPU path, reused across calls."""

    def __init__(self, dev, kernels, core, name, dtype, count):
        self.dev, self.kernels, self.core = dev, kernels, core
        self.name, self.dtype, self.count = name, dtype, count
        self.code, storage = harness.DTYPES[dtype]
        self.nbytes = count * np.dtype(storage).itemsize
        self.inputs = [dev.empty(self.nbytes), dev.empty(self.nbytes)]
        self.reduced = dev.empty(self.nbytes)
        self.staging = dev.pinned(self.nbytes)
        self.host = self.staging[:self.nbytes].view(host_dtype(dtype))
        self.dtype_name = "bfloat16" if dtype == "bfloat16" else ""

    def run(self, phases=None):
        """The kernel's steps; with phases, the seconds of each are appended."""
        t0 = time.perf_counter()
        if self.count:
            self.kernels.sum(self.code, self.dev.ptr(self.reduced),
                             [self.dev.ptr(b) for b in self.inputs], self.count,
                             self.dev.bufs.stream)
        self.dev.sync()
        t1 = time.perf_counter()
        self.dev.copy_async(self.host.ctypes.data, self.dev.ptr(self.reduced), self.nbytes, 2)
        self.dev.sync()
        t2 = time.perf_counter()
        self.core.push_pull_async(self.name, self.host, self.host, 0, self.dtype_name).wait(300.0)
        t3 = time.perf_counter()
        self.dev.copy_async(self.dev.ptr(self.reduced), self.host.ctypes.data, self.nbytes, 1)
        self.dev.sync()
        t4 = time.perf_counter()
        if phases is not None:
            for key, dt in zip(("reduce", "d2h", "push_pull", "h2d"), (t1 - t0, t2 - t1,
                                                                       t3 - t2, t4 - t3)):
                phases.setdefault(key, []).append(dt)
            phases.setdefault("total", []).append(t4 - t0)


def pattern(count, offset):
    # Small integers: every partial sum is exact in float16 and bfloat16 too.
    return (np.arange(count) % 13 + offset).astype(np.float32)


def check_case(dev, kernels, core, rank, size, dtype, count):
    pp = GpuPushPull(dev, kernels, core, f"check/{dtype}/{count}", dtype, count)
    local = [pattern(count, rank + 1), pattern(count, 2 * rank + 1)]
    for buf, values in zip(pp.inputs, local):
        dev.put(buf, values.astype(host_dtype(dtype)))
    pp.run()
    want = sum(pattern(count, r + 1) + pattern(count, 2 * r + 1) for r in range(size))
    want = np.asarray(want, dtype=np.float32).astype(host_dtype(dtype))
    got = dev.get(pp.reduced, pp.nbytes).view(host_dtype(dtype))
    same = bool(np.array_equal(got.view(np.uint8), want.view(np.uint8)))
    return {"dtype": dtype, "count": count, "correct": same,
            "first_bad": None if same else int(np.flatnonzero(got != want)[0])}


def time_size(dev, kernels, core, rank, nbytes, warmup, reps):
    count = nbytes // 4
    pp = GpuPushPull(dev, kernels, core, f"time/gpu/{nbytes}", "float32", count)
    for buf in pp.inputs:
        dev.put(buf, np.full(count, float(rank + 1), dtype=np.float32))
    cpu_in = np.full(count, float(rank + 1), dtype=np.float32)
    cpu_out = np.empty_like(cpu_in)
    t0 = time.perf_counter()
    fresh = dev.pinned(nbytes)
    fresh[::4096] = 0  # touch every page, as a first copy would
    pinned_alloc = time.perf_counter() - t0
    del fresh
    phases, cpu = {}, []
    for k in range(warmup + reps):
        keep = k >= warmup
        pp.run(phases if keep else None)
        t0 = time.perf_counter()
        core.push_pull_async(f"time/cpu/{nbytes}", cpu_in, cpu_out, 0, "").wait(300.0)
        if keep:
            cpu.append(time.perf_counter() - t0)
    return {"bytes": nbytes, "pinned_alloc_s": pinned_alloc, "cpu_push_pull": cpu, **phases}


def main():
    spec = json.load(open(sys.argv[1]))
    bps_tf.init()
    core, rank, size = basics.core(), basics.rank(), basics.size()
    dev = Device(spec.get("emulate", False))
    kernels = harness.Kernels(spec["lib"], prefix="bps_host" if dev.emulate else "bps_gpu")
    part = int(spec["partition_bytes"])
    checks = []
    for dtype in spec["check_dtypes"]:
        per = part // np.dtype(harness.DTYPES[dtype][1]).itemsize
        for count in (0, 1, 7, per - 1, per, per + 1, 2 * per + 3, 3 * per):
            checks.append(check_case(dev, kernels, core, rank, size, dtype, count))
    timings = [time_size(dev, kernels, core, rank, nbytes, spec["warmup"],
                         max(3, min(spec["reps"], (spec["rep_budget_bytes"]) // nbytes)))
               for nbytes in spec["sizes"]]
    out = os.path.join(spec["out_dir"], f"worker{rank}.json")
    with open(out + ".tmp", "w") as f:
        json.dump({"rank": rank, "size": size, "device": dev.name, "checks": checks,
                   "timings": timings,
                   "medians": [{k: (statistics.median(v) if isinstance(v, list) else v)
                                for k, v in t.items()} for t in timings]}, f)
    os.replace(out + ".tmp", out)
    basics.shutdown()


if __name__ == "__main__":
    main()
