"""Checks and times the CUDA reduce kernels (bps_tf/core/gpu/gpu_reduce.cu), no TensorFlow.

    python tests/gpu/harness.py --build      # build libbps_gpu_reduce.so, check, time
    python tests/gpu/harness.py --emulate    # same checks on the CPU (no GPU needed)

Correctness: fresh random data for every dtype, many sizes (0 .. 1e6+3) and
misaligned offsets (by elements and by single bytes), compared with numpy:
bit-exact where the arithmetic is exact, within one unit in the last place
for float16/bfloat16 sums. Guard bytes around every output catch stray
writes. Bandwidth: sums of 2, 4 and 8 buffers, scale and the casts against
cudaMemcpyAsync device-to-device of the same buffer, from 1 MiB to 256 MiB,
counting bytes read and written; a table on stdout and JSON in build/gpu/.

Device buffers come from CuPy or PyTorch, whichever imports. Exit status:
0 all checks passed, 1 a check failed, 2 no GPU, no buffer library or no
library built.
"""
import argparse
import ctypes
import json
import os
import platform
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_LIB = os.path.join(REPO, "build", "gpu", "libbps_gpu_reduce.so")
DEFAULT_EMU_LIB = os.path.join(REPO, "build", "gpu", "libbps_gpu_reduce_emu.so")
DEFAULT_JSON = os.path.join(REPO, "build", "gpu", "harness_results.json")
SIZES = [0, 1, 2, 3, 7, 31, 4097, 1_000_003]
BENCH_MIB = [1, 4, 16, 64, 256]
TARGET_RATIO = 0.85
GUARD = 48  # bytes before and after each buffer's data, filled with a pattern

# dtype name -> (bps_dtype code, numpy storage dtype)
DTYPES = {
    "float16": (0, np.float16),
    "bfloat16": (1, np.uint16),  # numpy has no bfloat16: its bits in uint16
    "float32": (2, np.float32),
    "float64": (3, np.float64),
    "int32": (4, np.int32),
    "int64": (5, np.int64),
}
HALF_TYPES = ("float16", "bfloat16")
INT_TYPES = ("int32", "int64")


# ---- numpy references ----

def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    """float32 -> bfloat16 bits, round to nearest even (NaN stays NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    out = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    out[nan] = ((u[nan] >> 16).astype(np.uint16) & 0x8000) | 0x7FC0
    return out


def to_f32(name, a):
    return bf16_to_f32(a) if name == "bfloat16" else a.astype(np.float32)


def from_f32(name, x):
    with np.errstate(over="ignore"):  # values past float16's range become inf, as intended
        return f32_to_bf16(x) if name == "bfloat16" else x.astype(np.float16)


def ref_sum(name, srcs, group=16):
    """What the kernels compute: half types add in float32 and round once per
    group of 16 sources; integers wrap (numpy's integer add wraps too)."""
    if name not in HALF_TYPES:
        acc = srcs[0].copy()
        with np.errstate(over="ignore"):
            for s in srcs[1:]:
                acc += s
        return acc
    out, rest = None, list(srcs)
    while rest:
        chunk = ([out] if out is not None else []) + rest[:group - (out is not None)]
        rest = rest[group - (out is not None):]
        acc = to_f32(name, chunk[0])
        for s in chunk[1:]:
            acc = acc + to_f32(name, s)
        out = from_f32(name, acc)
    return out


def ref_scale(name, a, factor):
    if name in HALF_TYPES:
        return from_f32(name, to_f32(name, a) * np.float32(factor))
    return a * a.dtype.type(factor)


def ref_average(name, a, n):
    if name in INT_TYPES:
        with np.errstate(over="ignore"):
            return a // a.dtype.type(n)
    return ref_scale(name, a, 1.0 / n)


def random_values(name, rng, count):
    if name in INT_TYPES:
        info = np.iinfo(DTYPES[name][1])  # full range: sums wrap, as on the GPU
        return rng.integers(info.min, info.max, size=count, dtype=DTYPES[name][1],
                            endpoint=True)
    if name in ("float32", "float64"):
        # Integer values: every summation order gives the exact same answer.
        return rng.integers(-2**20, 2**20, size=count).astype(DTYPES[name][1])
    x = rng.standard_normal(count).astype(np.float32) * 8
    return from_f32(name, x)


def special_f32(rng, count):
    """float32 values for the casts: normal, tiny, huge, inf, nan, ties."""
    x = (rng.standard_normal(count) * 100).astype(np.float32)
    pool = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-8, -3e-7, 65504.0, 65520.0,
                     70000.0, 1e30, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.0 + 2**-8,
                     1.0 + 3 * 2**-8], dtype=np.float32)
    if count:
        idx = rng.integers(0, count, size=min(count, 64))
        x[idx] = pool[rng.integers(0, len(pool), size=len(idx))]
    return x


def _bits(name, a):
    width = {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(DTYPES[name][1]).itemsize]
    return np.ascontiguousarray(a).view(width)


def half_ulps(got_bits, want_bits):
    """Distance in units in the last place between 16-bit float patterns."""
    def ordered(u):  # sign-magnitude -> integers in value order
        u = u.astype(np.int32)
        return np.where(u >= 0x8000, 0x8000 - u, u)
    return np.abs(ordered(got_bits) - ordered(want_bits))


def mismatch(name, got, want, ulps=0):
    """'' if got matches want, else a short description. Floats compare bit for
    bit (so -0.0 != +0.0); NaN equals NaN whatever its payload; ulps > 0 (half
    types only) allows that many units in the last place."""
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    if name in INT_TYPES:
        bad = got != want
    else:
        nan_g = np.isnan(to_f32(name, got) if name == "bfloat16" else got)
        nan_w = np.isnan(to_f32(name, want) if name == "bfloat16" else want)
        gb, wb = _bits(name, got), _bits(name, want)
        far = half_ulps(gb, wb) > ulps if ulps else gb != wb
        bad = (nan_g != nan_w) | (~nan_g & ~nan_w & far)
    idx = np.flatnonzero(bad)
    if idx.size == 0:
        return ""
    i = idx[0]
    return f"{idx.size} elements differ, first at {i}: got {got[i]!r} want {want[i]!r}"


# ---- the kernels through ctypes ----

class KernelError(RuntimeError):
    def __init__(self, code, message):
        super().__init__(f"error {code}: {message}")
        self.code = code


class Kernels:
    """The C ABI of gpu_reduce.h. prefix 'bps_host' selects the CPU emulation."""

    def __init__(self, path, prefix="bps_gpu"):
        self.lib = ctypes.CDLL(path)
        self.prefix = prefix
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        sig = {
            "sum": [ctypes.c_int, vp, ctypes.POINTER(vp), ctypes.c_int, sz, vp],
            "scale": [ctypes.c_int, vp, sz, ctypes.c_double, vp],
            "average": [ctypes.c_int, vp, sz, ctypes.c_int64, vp],
            "cast_to_f32": [ctypes.c_int, vp, vp, sz, vp],
            "cast_from_f32": [ctypes.c_int, vp, vp, sz, vp],
        }
        self.fns = {}
        for name, args in sig.items():
            fn = getattr(self.lib, f"{prefix}_{name}")
            fn.argtypes, fn.restype = args, ctypes.c_int
            self.fns[name] = fn
        self.lib.bps_gpu_last_error_string.restype = ctypes.c_char_p

    def _call(self, name, *args):
        rc = self.fns[name](*args)
        if rc != 0:
            raise KernelError(rc, self.lib.bps_gpu_last_error_string().decode())

    def sum(self, dtype, dst, srcs, count, stream=0):
        arr = (ctypes.c_void_p * max(1, len(srcs)))(*srcs)
        self._call("sum", dtype, dst, arr, len(srcs), count, stream)

    def scale(self, dtype, data, count, factor, stream=0):
        self._call("scale", dtype, data, count, factor, stream)

    def average(self, dtype, data, count, n, stream=0):
        self._call("average", dtype, data, count, n, stream)

    def cast_to_f32(self, dtype, dst, src, count, stream=0):
        self._call("cast_to_f32", dtype, dst, src, count, stream)

    def cast_from_f32(self, dtype, dst, src, count, stream=0):
        self._call("cast_from_f32", dtype, dst, src, count, stream)


# ---- buffers: host (emulation), CuPy or PyTorch ----

class HostBuffers:
    """numpy memory for the CPU emulation of the kernels."""
    name, stream, l2_bytes = "host-emulation", 0, 0

    def empty(self, nbytes):
        return np.empty(nbytes, dtype=np.uint8)

    def ptr(self, buf):
        return buf.ctypes.data

    def put(self, buf, off, data):
        buf[off:off + data.size] = data

    def get(self, buf, off, nbytes):
        return buf[off:off + nbytes].copy()

    def sync(self):
        pass


class CupyBuffers:
    def __init__(self):
        import cupy
        self.cp = cupy
        self.s = cupy.cuda.Stream(non_blocking=True)
        self.stream = self.s.ptr
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        self.l2_bytes = int(props.get("l2CacheSize", 0))
        self.name = "cupy " + cupy.__version__
        self.device = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]

    def empty(self, nbytes):
        return self.cp.empty(max(nbytes, 1), dtype=self.cp.uint8)

    def ptr(self, buf):
        return buf.data.ptr

    # Copies run on our stream and finish before returning: it is a
    # non-blocking stream, which does not wait for the legacy default stream.
    def put(self, buf, off, data):
        buf[off:off + data.size].set(np.ascontiguousarray(data), stream=self.s)
        self.sync()

    def get(self, buf, off, nbytes):
        out = self.cp.asnumpy(buf[off:off + nbytes], stream=self.s)
        self.sync()
        return out

    def sync(self):
        self.s.synchronize()

    def copy(self, dst, src, nbytes):  # cudaMemcpyAsync, device to device
        self.cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, 3, self.stream)

    def timer(self):
        return self.cp.cuda.Event(), self.cp.cuda.Event()

    def record(self, event):
        event.record(self.s)

    def elapsed_ms(self, start, end):
        end.synchronize()
        return self.cp.cuda.get_elapsed_time(start, end)


class TorchBuffers:
    def __init__(self):
        import torch
        self.torch = torch
        self.s = torch.cuda.Stream()
        self.stream = self.s.cuda_stream
        self.name = "torch " + torch.__version__
        self.device = torch.cuda.get_device_name()
        self.l2_bytes = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0))

    def empty(self, nbytes):
        return self.torch.empty(max(nbytes, 1), dtype=self.torch.uint8, device="cuda")

    def ptr(self, buf):
        return buf.data_ptr()

    def put(self, buf, off, data):
        self.sync()
        buf[off:off + data.size].copy_(self.torch.from_numpy(np.ascontiguousarray(data)))
        self.torch.cuda.synchronize()

    def get(self, buf, off, nbytes):
        self.sync()
        return buf[off:off + nbytes].cpu().numpy()

    def sync(self):
        self.s.synchronize()

    def copy(self, dst, src, nbytes):  # a cudaMemcpyAsync device to device
        with self.torch.cuda.stream(self.s):
            dst[:nbytes].copy_(src[:nbytes], non_blocking=True)

    def timer(self):
        return (self.torch.cuda.Event(enable_timing=True),
                self.torch.cuda.Event(enable_timing=True))

    def record(self, event):
        event.record(self.s)

    def elapsed_ms(self, start, end):
        end.synchronize()
        return start.elapsed_time(end)


def cuda_device_count():
    """GPUs the driver sees (0 without a driver); needs neither CuPy nor PyTorch."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def gpu_buffers(which="auto"):
    errors = []
    for name, cls in (("cupy", CupyBuffers), ("torch", TorchBuffers)):
        if which in ("auto", name):
            try:
                return cls()
            except Exception as exc:  # import or CUDA initialisation failed
                errors.append(f"{name}: {exc}")
    raise RuntimeError("no device buffer library: install CuPy (e.g. `pip install cupy-cuda12x`)"
                       " or PyTorch with CUDA. " + "; ".join(errors))


# ---- correctness ----

class Checker:
    """Places arrays at chosen byte offsets inside guarded buffers and runs one
    kernel call against its numpy reference."""

    def __init__(self, kernels, bufs, rng):
        self.k, self.b, self.rng = kernels, bufs, rng
        self.failures, self.checked = [], 0

    def place(self, arr, offset):
        raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        buf = self.b.empty(GUARD + offset + raw.size + GUARD)
        pattern = np.full(GUARD + offset + raw.size + GUARD, 0xA5, dtype=np.uint8)
        pattern[GUARD + offset:GUARD + offset + raw.size] = raw
        self.b.put(buf, 0, pattern)
        return buf, GUARD + offset, raw.size

    def read(self, placed, dtype):
        buf, off, nbytes = placed
        whole = self.b.get(buf, 0, off + nbytes + GUARD)
        if (whole[:off] != 0xA5).any() or (whole[off + nbytes:] != 0xA5).any():
            return None  # a kernel wrote outside the array
        return whole[off:off + nbytes].copy().view(dtype)

    def ptr(self, placed):
        return self.b.ptr(placed[0]) + placed[1]

    def expect(self, label, name, placed, dtype, want, ulps=0):
        self.b.sync()
        got = self.read(placed, dtype)
        self.checked += 1
        why = "wrote outside its buffer" if got is None else mismatch(name, got, want, ulps)
        if why:
            self.failures.append(f"{label}: {why}")

    def run(self, label, fn):
        try:
            fn()
        except KernelError as exc:
            self.checked += 1
            self.failures.append(f"{label}: {exc}")
            return False
        return True


# Byte offsets of (dst, src0, src1, ...) in elements unless marked bytes.
LAYOUTS = {
    "aligned": lambda e: (0, 0, 0),
    "shifted": lambda e: (e, e, e),            # same misalignment: head, vectors, tail
    "mixed": lambda e: (0, e, 3 * e),          # different misalignments: scalar path
    "odd-bytes": lambda e: (1, 3, 0) if e > 1 else (1, 2, 3),  # not element-aligned
}


def check_dtype(ck, name, sizes):
    code, npt = DTYPES[name]
    esize = np.dtype(npt).itemsize
    ulps = 1 if name in HALF_TYPES else 0
    for count in sizes:
        for layout, offsets in LAYOUTS.items():
            o = offsets(esize)
            tag = f"{name} n={count} {layout}"
            a, b, c = (random_values(name, ck.rng, count) for _ in range(3))
            # dst = a + b + c, out of place
            pa, pb, pc = ck.place(a, o[1]), ck.place(b, o[2]), ck.place(c, o[1])
            pd = ck.place(np.zeros(count, npt), o[0])
            if ck.run(tag + " sum3", lambda: ck.k.sum(code, ck.ptr(pd), [ck.ptr(pa), ck.ptr(pb),
                                                      ck.ptr(pc)], count, ck.b.stream)):
                ck.expect(tag + " sum3", name, pd, npt, ref_sum(name, [a, b, c]), ulps)
            # in place: a += b
            pa2 = ck.place(a, o[0])
            if ck.run(tag + " sum-in-place", lambda: ck.k.sum(
                    code, ck.ptr(pa2), [ck.ptr(pa2), ck.ptr(pb)], count, ck.b.stream)):
                ck.expect(tag + " sum-in-place", name, pa2, npt, ref_sum(name, [a, b]), ulps)
            # one source is a copy
            pd1 = ck.place(np.zeros(count, npt), o[0])
            if ck.run(tag + " sum1", lambda: ck.k.sum(code, ck.ptr(pd1), [ck.ptr(pb)], count,
                                                      ck.b.stream)):
                ck.expect(tag + " sum1", name, pd1, npt, b)
            # averages: floor division for integers (negative divisor too)
            for n in ((3, -2) if name in INT_TYPES else (4, 3)):
                pv = ck.place(a, o[0])
                if ck.run(f"{tag} average/{n}", lambda: ck.k.average(code, ck.ptr(pv), count, n,
                                                                      ck.b.stream)):
                    ck.expect(f"{tag} average/{n}", name, pv, npt, ref_average(name, a, n))
            if name not in INT_TYPES:
                ps = ck.place(a, o[0])
                if ck.run(tag + " scale", lambda: ck.k.scale(code, ck.ptr(ps), count, 0.37,
                                                             ck.b.stream)):
                    ck.expect(tag + " scale", name, ps, npt, ref_scale(name, a, 0.37))
            if name in HALF_TYPES:
                check_casts(ck, name, code, count, o, tag)
    # More sources than one launch takes (16): later groups add into dst.
    many = [random_values(name, ck.rng, 4097) for _ in range(37)]
    placed = [ck.place(s, 0) for s in many]
    pd = ck.place(np.zeros(4097, npt), 0)
    if ck.run(f"{name} sum37", lambda: ck.k.sum(code, ck.ptr(pd), [ck.ptr(p) for p in placed],
                                                4097, ck.b.stream)):
        ck.expect(f"{name} sum37", name, pd, npt, ref_sum(name, many), ulps)
    # No sources: zeros.
    pz = ck.place(random_values(name, ck.rng, 31), 0)
    if ck.run(f"{name} sum0", lambda: ck.k.sum(code, ck.ptr(pz), [], 31, ck.b.stream)):
        ck.expect(f"{name} sum0", name, pz, npt, np.zeros(31, npt))


def check_casts(ck, name, code, count, o, tag):
    npt = DTYPES[name][1]
    x = special_f32(ck.rng, count)
    px, ph = ck.place(x, o[1]), ck.place(np.zeros(count, npt), o[0])
    if ck.run(tag + " from_f32", lambda: ck.k.cast_from_f32(code, ck.ptr(ph), ck.ptr(px), count,
                                                            ck.b.stream)):
        ck.expect(tag + " from_f32", name, ph, npt, from_f32(name, x))
    h = random_values(name, ck.rng, count)
    ph2, pf = ck.place(h, o[2]), ck.place(np.zeros(count, np.float32), o[0])
    if ck.run(tag + " to_f32", lambda: ck.k.cast_to_f32(code, ck.ptr(pf), ck.ptr(ph2), count,
                                                        ck.b.stream)):
        ck.expect(tag + " to_f32", "float32", pf, np.float32, to_f32(name, h))


def check_errors(ck):
    """Bad arguments come back as cudaErrorInvalidValue (1) with a message."""
    cases = [
        ("unknown dtype", lambda: ck.k.sum(9, 0, [], 1, ck.b.stream), "dtype"),
        ("scale of int32", lambda: ck.k.scale(4, 8, 1, 0.5, ck.b.stream), "integer"),
        ("average by 0", lambda: ck.k.average(2, 8, 1, 0, ck.b.stream), "n is 0"),
        ("cast of float64", lambda: ck.k.cast_to_f32(3, 8, 8, 1, ck.b.stream), "float16"),
        ("NULL dst", lambda: ck.k.sum(2, 0, [8], 1, ck.b.stream), "NULL"),
    ]
    for label, fn, words in cases:
        ck.checked += 1
        try:
            fn()
            ck.failures.append(f"{label}: accepted")
        except KernelError as exc:
            if exc.code != 1 or words not in str(exc):
                ck.failures.append(f"{label}: unexpected {exc}")


def run_checks(kernels, bufs, sizes=SIZES, dtypes=tuple(DTYPES), seed=None):
    seed = int(time.time_ns() % 2**32) if seed is None else seed
    ck = Checker(kernels, bufs, np.random.default_rng(seed))
    for name in dtypes:
        check_dtype(ck, name, sizes)
    check_errors(ck)
    return {"seed": seed, "checked": ck.checked, "failures": ck.failures}


# ---- bandwidth ----

def time_ms(bufs, fn, iters, sets=1):
    """Mean ms of fn(k) over iters calls; k picks one of `sets` buffer sets, a
    fresh one each call, so that no call finds its data in L2 when sets > 1."""
    fn(0)  # warm up (and first-launch setup)
    start, end = bufs.timer()
    bufs.sync()
    bufs.record(start)
    for k in range(1, iters + 1):
        fn(k % sets)
    bufs.record(end)
    return bufs.elapsed_ms(start, end) / iters


# The timed operations: name -> (dtypes it applies to, bytes moved per element
# as a multiple of the element size). Sums of n buffers read n and write 1;
# scale works in place; the casts read one width and write the other.
BENCH_OPS = {
    "sum2": (None, 3), "sum4": (None, 5), "sum8": (None, 9),
    "scale": (("float16", "bfloat16", "float32", "float64"), 2),
    "cast_to_f32": (HALF_TYPES, 3), "cast_from_f32": (HALF_TYPES, 3),
}


def cold_sets(bufs, nbytes):
    """Buffer sets to rotate through so that the smallest footprint timed (a
    copy: 2 buffers) cycles through 3x the GPU's L2 before coming back: every
    call then runs from memory, as the sizes that do not fit in L2 do. Without
    this the copy of a 16 MiB buffer ran from an H200's 60 MB L2, at 5 TB/s."""
    l2 = bufs.l2_bytes
    return max(1, -(-3 * l2 // (2 * nbytes))) if l2 else 1


def bench(kernels, bufs, mibs=BENCH_MIB, dtypes=("float32", "float16"), ops=tuple(BENCH_OPS)):
    """Per dtype and size: each op against a D2D copy of the same buffer,
    timed back to back on the same stream, both with a cold L2."""
    rows = []
    for name in dtypes:
        code, npt = DTYPES[name]
        for mib in mibs:
            nbytes = mib << 20
            count = nbytes // np.dtype(npt).itemsize
            nsets = cold_sets(bufs, nbytes)
            data = random_values(name, np.random.default_rng(mib), count).view(np.uint8)
            sets = []
            for k in range(nsets):
                srcs = [bufs.empty(nbytes) for _ in range(8)]
                for sb in srcs:
                    if k == 0:
                        bufs.put(sb, 0, data)
                    else:
                        bufs.copy(sb, sets[0]["srcs"][0], nbytes)
                sets.append({"srcs": srcs, "ptrs": [bufs.ptr(sb) for sb in srcs],
                             "out": bufs.empty(nbytes), "wide": bufs.empty(count * 4)})
            bufs.sync()
            iters = max(5, min(200, (2 << 30) // nbytes))
            t_copy = time_ms(bufs, lambda k: bufs.copy(sets[k]["out"], sets[k]["srcs"][0],
                                                       nbytes), iters, nsets)
            copy_gbs = 2 * nbytes / t_copy / 1e6
            st = bufs.stream
            calls = {
                "sum2": lambda k: kernels.sum(code, bufs.ptr(sets[k]["out"]), sets[k]["ptrs"][:2],
                                              count, st),
                "sum4": lambda k: kernels.sum(code, bufs.ptr(sets[k]["out"]), sets[k]["ptrs"][:4],
                                              count, st),
                "sum8": lambda k: kernels.sum(code, bufs.ptr(sets[k]["out"]), sets[k]["ptrs"][:8],
                                              count, st),
                # factor 1: repeated in-place scaling leaves the data unchanged
                "scale": lambda k: kernels.scale(code, sets[k]["ptrs"][1], count, 1.0, st),
                "cast_to_f32": lambda k: kernels.cast_to_f32(code, bufs.ptr(sets[k]["wide"]),
                                                             sets[k]["ptrs"][0], count, st),
                "cast_from_f32": lambda k: kernels.cast_from_f32(
                    code, bufs.ptr(sets[k]["out"]), bufs.ptr(sets[k]["wide"]), count, st),
            }
            for op in ops:
                kinds, moved = BENCH_OPS[op]
                if kinds is not None and name not in kinds:
                    continue
                t_op = time_ms(bufs, calls[op], iters, nsets)
                op_gbs = moved * nbytes / t_op / 1e6
                rows.append({"op": op, "dtype": name, "mib": mib, "op_ms": round(t_op, 4),
                             "copy_ms": round(t_copy, 4), "op_gbs": round(op_gbs, 1),
                             "copy_gbs": round(copy_gbs, 1), "ratio": round(op_gbs / copy_gbs, 3),
                             "buffer_sets": nsets})
            sets.clear()  # frees the device buffers before the next size
    return rows


def print_table(rows):
    print(f"{'op':>13} {'dtype':>9} {'MiB':>5} {'op ms':>9} {'op GB/s':>9} {'copy ms':>9} "
          f"{'copy GB/s':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['op']:>13} {r['dtype']:>9} {r['mib']:>5} {r['op_ms']:>9.3f} "
              f"{r['op_gbs']:>9.1f} {r['copy_ms']:>9.3f} {r['copy_gbs']:>9.1f} {r['ratio']:>6.2f}")
    print("GB/s count reads and writes: a sum of n buffers moves n+1 times the buffer, scale 2x, "
          "a cast 3x (the half-width side once, the float32 side twice), a copy 2x.")


def target_verdicts(rows, min_mib=16, target=TARGET_RATIO):
    """One line per (op, dtype) over the sizes >= min_mib, and whether all meet."""
    lines, ok = [], True
    keys = sorted({(r["op"], r["dtype"]) for r in rows if r["mib"] >= min_mib})
    for op, dtype in keys:
        worst = min((r for r in rows if (r["op"], r["dtype"]) == (op, dtype)
                     and r["mib"] >= min_mib), key=lambda r: r["ratio"])
        met = worst["ratio"] >= target
        ok &= met
        lines.append(f"{op} {dtype}: lowest ratio at >= {min_mib} MiB is {worst['ratio']:.0%} "
                     f"({worst['mib']} MiB): {'meets' if met else 'misses'} the "
                     f"{target:.0%} target")
    return lines, ok


# ---- command line ----

def parse_list(text, kind=int):
    return [kind(float(x)) if kind is int else kind(x) for x in text.split(",") if x]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", action="store_true", help="build the library with nvcc first")
    ap.add_argument("--emulate", action="store_true",
                    help="run the checks on the CPU emulation of the kernels (no GPU)")
    ap.add_argument("--lib", default=None, help="library to load (default: build/gpu/...)")
    ap.add_argument("--archs", default=None, help="compute capabilities for --build, e.g. 90")
    ap.add_argument("--backend", default="auto", choices=["auto", "cupy", "torch"])
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="element counts to check")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--bench-mib", default=",".join(map(str, BENCH_MIB)),
                    help="buffer sizes to time, MiB ('' skips timing)")
    ap.add_argument("--bench-dtypes", default="float32,float16")
    ap.add_argument("--bench-ops", default=",".join(BENCH_OPS))
    ap.add_argument("--json", default=None,
                    help="results file (default: build/gpu/harness_results[_emulated].json)")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)

    lib = args.lib or (DEFAULT_EMU_LIB if args.emulate else DEFAULT_LIB)
    if args.build:
        sys.path.insert(0, os.path.join(REPO, "tools"))
        import build_gpu
        _, secs = build_gpu.build_reduce_library(lib, args.archs, emulation=args.emulate)
        print(f"built {lib} in {secs:.1f} s", flush=True)
    if not os.path.exists(lib):
        print(f"{lib} does not exist: add --build (needs nvcc) or pass --lib")
        return 2
    if args.emulate:
        bufs, kernels = HostBuffers(), Kernels(lib, prefix="bps_host")
        device = "CPU emulation (" + platform.machine() + ")"
    else:
        if cuda_device_count() == 0:
            print("no CUDA GPU on this machine (try --emulate for the CPU checks)")
            return 2
        try:
            bufs = gpu_buffers(args.backend)
        except RuntimeError as exc:
            print(exc)
            return 2
        kernels, device = Kernels(lib), bufs.device

    print(f"device: {device}; buffers: {bufs.name}; library: {lib}", flush=True)
    start = time.monotonic()
    result = run_checks(kernels, bufs, parse_list(args.sizes), parse_list(args.dtypes, str),
                        args.seed)
    print(f"correctness: {result['checked']} checks, {len(result['failures'])} failed "
          f"(seed {result['seed']}, {time.monotonic() - start:.1f} s)", flush=True)
    for f in result["failures"][:30]:
        print("  FAIL " + f)
    rows = []
    if not args.emulate and args.bench_mib:
        rows = bench(kernels, bufs, parse_list(args.bench_mib), parse_list(args.bench_dtypes, str),
                     parse_list(args.bench_ops, str))
        print_table(rows)
        lines, _ = target_verdicts(rows)
        for line in lines:
            print(line)
    out = args.json or (DEFAULT_JSON.replace(".json", "_emulated.json") if args.emulate
                        else DEFAULT_JSON)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"device": device, "buffers": bufs.name, "library": lib,
                   "correctness": result, "bandwidth": rows,
                   "target_ratio_at_16mib_and_up": TARGET_RATIO}, f, indent=1)
    print(f"results: {out}")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
