// CUDA kernels of the local reduction: sum of N buffers, in-place scaling and
// float16/bfloat16 <-> float32 casts (contract in gpu_reduce.h).
//
// Only CUDA headers here, never TensorFlow's: this file compiles in seconds.
//
// Shape of every kernel: one grid-stride kernel template runs an "op" over a
// Span, which splits the elements into a scalar head, a body of 16-byte
// vectors (every pointer 16-byte aligned there) and a scalar tail. The
// per-thread code is __host__ __device__ so that tests can run it on the CPU
// (BPS_GPU_HOST_EMULATION) when no GPU is at hand.
#include "gpu_reduce.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>

#define BPS_HD __host__ __device__ __forceinline__

namespace {

constexpr int kThreads = 256;
constexpr int kMaxSrcs = 16;   // sources per launch: keeps kernel parameters small
constexpr int kVecBytes = 16;  // one uint4 load or store

// ---- element types: how a value is stored and in which type it adds up ----

struct Half {
  using Storage = uint16_t;
  using Acc = float;
  static constexpr bool kInteger = false;
  // Through __half_raw: its conversions are __host__ __device__ in every
  // CUDA release, unlike some of the bit-cast intrinsics.
  static BPS_HD float ToAcc(uint16_t bits) {
    __half_raw r;
    r.x = bits;
    return __half2float(__half(r));
  }
  static BPS_HD uint16_t FromAcc(float f) {
    __half_raw r = __float2half_rn(f);
    return r.x;
  }
};

struct BFloat16 {
  using Storage = uint16_t;
  using Acc = float;
  static constexpr bool kInteger = false;
  static BPS_HD float ToAcc(uint16_t bits) {
    __nv_bfloat16_raw r;
    r.x = bits;
    return __bfloat162float(__nv_bfloat16(r));
  }
  static BPS_HD uint16_t FromAcc(float f) {
    __nv_bfloat16_raw r = __float2bfloat16_rn(f);
    return r.x;
  }
};

template <typename T>
struct Plain {
  using Storage = T;
  using Acc = T;
  static constexpr bool kInteger = false;
  static BPS_HD T ToAcc(T v) { return v; }
  static BPS_HD T FromAcc(T v) { return v; }
};
using Float32 = Plain<float>;
using Float64 = Plain<double>;

// Integers add as unsigned so that overflow wraps (as in TensorFlow and the
// CPU path) instead of being undefined behaviour.
template <typename S, typename U>
struct Integer {
  using Storage = S;
  using Acc = U;
  static constexpr bool kInteger = true;
  static BPS_HD U ToAcc(S v) { return static_cast<U>(v); }
  static BPS_HD S FromAcc(U v) { return static_cast<S>(v); }
};
using Int32 = Integer<int32_t, uint32_t>;
using Int64 = Integer<int64_t, uint64_t>;

// ---- memory access ----

// Element access. `direct` is false only when some pointer is not a multiple
// of its element size (e.g. a float buffer at an odd byte address): then
// elements move byte by byte, slow but correct. The flag is the same for
// every thread of a launch, so the branch costs next to nothing, and one
// kernel per op and type (not two) keeps the compile short.
template <typename T>
BPS_HD T LoadAt(bool direct, const void* base, size_t i) {
  if (direct) return static_cast<const T*>(base)[i];
  T v;
  memcpy(&v, static_cast<const char*>(base) + i * sizeof(T), sizeof(T));
  return v;
}

template <typename T>
BPS_HD void StoreAt(bool direct, void* base, size_t i, T v) {
  if (direct) {
    static_cast<T*>(base)[i] = v;
  } else {
    memcpy(static_cast<char*>(base) + i * sizeof(T), &v, sizeof(T));
  }
}

// 16 bytes seen as elements; used only at 16-byte aligned addresses.
template <typename T>
union Pack {
  uint4 raw;
  T e[kVecBytes / sizeof(T)];
};

#if defined(BPS_GPU_HOST_EMULATION)
// A misaligned vector access faults on the GPU but not always on the CPU: the
// emulation records it (and copies bytewise) so that tests catch it.
thread_local bool g_emulated_misaligned = false;
#if !defined(__CUDA_ARCH__)
inline void EmulatedCopy16(void* to, const void* from, const void* addr) {
  if (reinterpret_cast<uintptr_t>(addr) % kVecBytes != 0) g_emulated_misaligned = true;
  memcpy(to, from, kVecBytes);
}
#endif
#endif

template <typename T>
BPS_HD Pack<T> LoadPack(const void* base, size_t i) {
  const T* at = static_cast<const T*>(base) + i;
  Pack<T> p;
#if defined(BPS_GPU_HOST_EMULATION) && !defined(__CUDA_ARCH__)
  EmulatedCopy16(&p.raw, at, at);
#else
  p.raw = *reinterpret_cast<const uint4*>(at);
#endif
  return p;
}

template <typename T>
BPS_HD void StorePack(void* base, size_t i, const Pack<T>& p) {
  T* at = static_cast<T*>(base) + i;
#if defined(BPS_GPU_HOST_EMULATION) && !defined(__CUDA_ARCH__)
  EmulatedCopy16(at, &p.raw, at);
#else
  *reinterpret_cast<uint4*>(at) = p.raw;
#endif
}

// ---- work split ----

// Elements [0, head) and [head + nvec * kVec, count) one at a time; the
// vectors in between, each starting at an index where all pointers are
// 16-byte aligned. `direct`: every pointer is a multiple of its element size.
struct Span {
  size_t count;
  size_t head;
  size_t nvec;
  bool direct;
};

template <class Op>
BPS_HD void RunSpan(const Op& op, const Span& s, size_t tid, size_t nthreads) {
  for (size_t i = tid; i < s.head; i += nthreads) op.Element(i, s.direct);
  for (size_t v = tid; v < s.nvec; v += nthreads) op.Vector(s.head + v * Op::kVec);
  for (size_t i = s.head + s.nvec * Op::kVec + tid; i < s.count; i += nthreads) {
    op.Element(i, s.direct);
  }
}

struct Ptr {
  const void* p;
  size_t elem;  // element size at this pointer
};

// Finds the vector body: the first index h < vec at which every pointer is
// 16-byte aligned. Buffers whose misalignments differ get no body (all
// scalar), and so do buffers not aligned to their element size.
Span PlanSpan(const Ptr* ptrs, int n, size_t count, int vec) {
  Span s{count, 0, 0, true};
  for (int k = 0; k < n; ++k) {
    if (reinterpret_cast<uintptr_t>(ptrs[k].p) % ptrs[k].elem != 0) s.direct = false;
  }
  if (!s.direct) return s;
  for (size_t h = 0; h < static_cast<size_t>(vec) && h < count; ++h) {
    bool ok = true;
    for (int k = 0; k < n && ok; ++k) {
      ok = (reinterpret_cast<uintptr_t>(ptrs[k].p) + h * ptrs[k].elem) % kVecBytes == 0;
    }
    if (ok) {
      s.head = h;
      s.nvec = (count - h) / vec;
      return s;
    }
  }
  return s;
}

// ---- ops: what one element and one vector of work do ----

template <class E>
struct SumOp {
  using S = typename E::Storage;
  using A = typename E::Acc;
  static constexpr int kVec = kVecBytes / sizeof(S);
  void* dst;
  const void* src[kMaxSrcs];
  int nsrcs;

  BPS_HD void Element(size_t i, bool direct) const {
    A acc = E::ToAcc(LoadAt<S>(direct, src[0], i));
    for (int k = 1; k < nsrcs; ++k) acc += E::ToAcc(LoadAt<S>(direct, src[k], i));
    StoreAt<S>(direct, dst, i, E::FromAcc(acc));
  }
  // Reads every source at i before writing dst at i: dst == src[0] is safe.
  BPS_HD void Vector(size_t i) const {
    A acc[kVec];
    Pack<S> in = LoadPack<S>(src[0], i);
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc[j] = E::ToAcc(in.e[j]);
    for (int k = 1; k < nsrcs; ++k) {
      in = LoadPack<S>(src[k], i);
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] += E::ToAcc(in.e[j]);
    }
    Pack<S> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.e[j] = E::FromAcc(acc[j]);
    StorePack<S>(dst, i, out);
  }
};

template <class E>
struct ScaleOp {
  using S = typename E::Storage;
  using A = typename E::Acc;
  static constexpr int kVec = kVecBytes / sizeof(S);
  void* data;
  A factor;

  BPS_HD S One(S v) const { return E::FromAcc(E::ToAcc(v) * factor); }
  BPS_HD void Element(size_t i, bool direct) const {
    StoreAt<S>(direct, data, i, One(LoadAt<S>(direct, data, i)));
  }
  BPS_HD void Vector(size_t i) const {
    Pack<S> p = LoadPack<S>(data, i);
#pragma unroll
    for (int j = 0; j < kVec; ++j) p.e[j] = One(p.e[j]);
    StorePack<S>(data, i, p);
  }
};

// numpy's `//`: the quotient rounded toward minus infinity. x // -1 is a
// negation that wraps (MIN // -1 == MIN, as numpy gives), never a trap.
template <class E>
BPS_HD typename E::Storage FloorDiv(typename E::Storage x, typename E::Storage d) {
  using S = typename E::Storage;
  if (d == -1) return E::FromAcc(typename E::Acc(0) - E::ToAcc(x));
  S q = x / d;
  S r = x % d;
  if (r != 0 && ((r < 0) != (d < 0))) --q;
  return q;
}

template <class E>
struct FloorDivOp {
  using S = typename E::Storage;
  static constexpr int kVec = kVecBytes / sizeof(S);
  void* data;
  S divisor;

  BPS_HD void Element(size_t i, bool direct) const {
    StoreAt<S>(direct, data, i, FloorDiv<E>(LoadAt<S>(direct, data, i), divisor));
  }
  BPS_HD void Vector(size_t i) const {
    Pack<S> p = LoadPack<S>(data, i);
#pragma unroll
    for (int j = 0; j < kVec; ++j) p.e[j] = FloorDiv<E>(p.e[j], divisor);
    StorePack<S>(data, i, p);
  }
};

// One vector = 8 half-width values = 16 bytes of them, 32 bytes of floats.
template <class E>
struct ToF32Op {
  static constexpr int kVec = 8;
  float* dst;
  const void* src;

  BPS_HD void Element(size_t i, bool direct) const {
    StoreAt<float>(direct, dst, i, E::ToAcc(LoadAt<uint16_t>(direct, src, i)));
  }
  BPS_HD void Vector(size_t i) const {
    Pack<uint16_t> in = LoadPack<uint16_t>(src, i);
    Pack<float> lo, hi;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      lo.e[j] = E::ToAcc(in.e[j]);
      hi.e[j] = E::ToAcc(in.e[j + 4]);
    }
    StorePack<float>(dst, i, lo);
    StorePack<float>(dst, i + 4, hi);
  }
};

template <class E>
struct FromF32Op {
  static constexpr int kVec = 8;
  void* dst;
  const float* src;

  BPS_HD void Element(size_t i, bool direct) const {
    StoreAt<uint16_t>(direct, dst, i, E::FromAcc(LoadAt<float>(direct, src, i)));
  }
  BPS_HD void Vector(size_t i) const {
    Pack<float> lo = LoadPack<float>(src, i);
    Pack<float> hi = LoadPack<float>(src, i + 4);
    Pack<uint16_t> out;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      out.e[j] = E::FromAcc(lo.e[j]);
      out.e[j + 4] = E::FromAcc(hi.e[j]);
    }
    StorePack<uint16_t>(dst, i, out);
  }
};

// ---- errors ----

thread_local char g_last_error[512];

int Fail(int code, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(g_last_error, sizeof(g_last_error), fmt, args);
  va_end(args);
  return code;
}

int Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return 0;
  return Fail(err, "%s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
}

// ---- launching: on the GPU, or emulated on the CPU for tests ----

template <class Op>
__global__ void __launch_bounds__(kThreads) GridStride(Op op, Span s) {
  RunSpan(op, s, blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x,
          static_cast<size_t>(gridDim.x) * blockDim.x);
}

template <class Op>
size_t WorkItems(const Span& s) {
  return s.head + s.nvec + (s.count - s.head - s.nvec * Op::kVec);
}

// Grid-stride loops need no more blocks than fit on the GPU at once; more
// would only add scheduling work. The fit is measured once per kernel.
template <class Op>
int MaxResidentBlocks() {
  static std::atomic<int> cached{0};
  int n = cached.load(std::memory_order_relaxed);
  if (n > 0) return n;
  int device = 0, sms = 1, per_sm = 1;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, GridStride<Op>, kThreads, 0) !=
          cudaSuccess) {
    cudaGetLastError();  // a failed query is not the caller's error
    return 1024;
  }
  n = sms * (per_sm > 0 ? per_sm : 1);
  cached.store(n, std::memory_order_relaxed);
  return n;
}

struct DeviceLaunch {
  cudaStream_t stream;

  template <class Op>
  int Run(const Op& op, const Span& s) const {
    size_t items = WorkItems<Op>(s);
    if (items == 0) return 0;
    size_t blocks = (items + kThreads - 1) / kThreads;
    size_t cap = static_cast<size_t>(MaxResidentBlocks<Op>());
    if (blocks > cap) blocks = cap;
    GridStride<Op><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(op, s);
    return Check(cudaGetLastError(), "kernel launch");
  }
  int Zero(void* dst, size_t bytes) const {
    if (bytes == 0) return 0;
    return Check(cudaMemsetAsync(dst, 0, bytes, stream), "cudaMemsetAsync");
  }
};

#ifdef BPS_GPU_HOST_EMULATION
// A small odd thread count so that every loop takes several strides and
// ragged ends; threads run one after another, which is a valid schedule
// because no element is touched by two threads.
struct HostLaunch {
  template <class Op>
  int Run(const Op& op, const Span& s) const {
    const size_t kEmulatedThreads = 37;
    g_emulated_misaligned = false;
    for (size_t t = 0; t < kEmulatedThreads; ++t) RunSpan(op, s, t, kEmulatedThreads);
    if (g_emulated_misaligned) {
      return Fail(cudaErrorMisalignedAddress, "emulation: a vector access was not 16-byte aligned");
    }
    return 0;
  }
  int Zero(void* dst, size_t bytes) const {
    if (bytes) memset(dst, 0, bytes);
    return 0;
  }
};
#endif

// ---- dispatch: dtype code -> element type ----

template <class F>
int WithDType(int dtype, const char* fn, F&& f) {
  switch (dtype) {
    case 0: return f(Half{});
    case 1: return f(BFloat16{});
    case 2: return f(Float32{});
    case 3: return f(Float64{});
    case 4: return f(Int32{});
    case 5: return f(Int64{});
    default:
      return Fail(cudaErrorInvalidValue, "%s: unknown dtype code %d (0..5 are valid)", fn, dtype);
  }
}

template <class E, class L>
int SumGroup(const L& launch, void* dst, const void* const* group, int n, size_t count) {
  using S = typename E::Storage;
  Ptr ptrs[kMaxSrcs + 1];
  ptrs[0] = {dst, sizeof(S)};
  for (int k = 0; k < n; ++k) ptrs[k + 1] = {group[k], sizeof(S)};
  SumOp<E> op;
  op.dst = dst;
  op.nsrcs = n;
  for (int k = 0; k < kMaxSrcs; ++k) op.src[k] = k < n ? group[k] : nullptr;
  return launch.Run(op, PlanSpan(ptrs, n + 1, count, SumOp<E>::kVec));
}

template <class L>
int Sum(const L& launch, int dtype, void* dst, const void* const* srcs, int nsrcs, size_t count) {
  if (nsrcs < 0 || (nsrcs > 0 && srcs == nullptr)) {
    return Fail(cudaErrorInvalidValue, "bps_gpu_sum: bad source list (nsrcs=%d)", nsrcs);
  }
  return WithDType(dtype, "bps_gpu_sum", [&](auto tag) -> int {
    using E = decltype(tag);
    if (count == 0) return 0;
    if (dst == nullptr) return Fail(cudaErrorInvalidValue, "bps_gpu_sum: dst is NULL");
    for (int k = 0; k < nsrcs; ++k) {
      if (srcs[k] == nullptr) return Fail(cudaErrorInvalidValue, "bps_gpu_sum: srcs[%d] is NULL", k);
    }
    if (nsrcs == 0) return launch.Zero(dst, count * sizeof(typename E::Storage));
    // More than kMaxSrcs sources: later groups add into dst, which then
    // leads the group as its first source (the in-place case).
    int next = 0;
    while (next < nsrcs) {
      const void* group[kMaxSrcs];
      int n = 0;
      if (next > 0) group[n++] = dst;
      while (n < kMaxSrcs && next < nsrcs) group[n++] = srcs[next++];
      int err = SumGroup<E>(launch, dst, group, n, count);
      if (err) return err;
    }
    return 0;
  });
}

template <class E, class L, class Op>
int RunInPlace(const L& launch, void* data, size_t count, const Op& op) {
  Ptr p{data, sizeof(typename E::Storage)};
  return launch.Run(op, PlanSpan(&p, 1, count, Op::kVec));
}

template <class L>
int Scale(const L& launch, int dtype, void* data, size_t count, double factor, const char* fn) {
  return WithDType(dtype, fn, [&](auto tag) -> int {
    using E = decltype(tag);
    if constexpr (E::kInteger) {
      return Fail(cudaErrorInvalidValue,
                  "%s: dtype %d is an integer type; use bps_gpu_average (floor division)", fn,
                  dtype);
    } else {
      if (count == 0) return 0;
      if (data == nullptr) return Fail(cudaErrorInvalidValue, "%s: data is NULL", fn);
      return RunInPlace<E>(launch, data, count,
                           ScaleOp<E>{data, static_cast<typename E::Acc>(factor)});
    }
  });
}

template <class L>
int Average(const L& launch, int dtype, void* data, size_t count, int64_t n) {
  if (n == 0) return Fail(cudaErrorInvalidValue, "bps_gpu_average: n is 0");
  return WithDType(dtype, "bps_gpu_average", [&](auto tag) -> int {
    using E = decltype(tag);
    if constexpr (E::kInteger) {
      using S = typename E::Storage;
      if (static_cast<int64_t>(static_cast<S>(n)) != n) {
        return Fail(cudaErrorInvalidValue, "bps_gpu_average: n=%lld does not fit dtype %d",
                    static_cast<long long>(n), dtype);
      }
      if (count == 0) return 0;
      if (data == nullptr) return Fail(cudaErrorInvalidValue, "bps_gpu_average: data is NULL");
      return RunInPlace<E>(launch, data, count, FloorDivOp<E>{data, static_cast<S>(n)});
    } else {
      return Scale(launch, dtype, data, count, 1.0 / static_cast<double>(n), "bps_gpu_average");
    }
  });
}

template <class F>
int WithHalfType(int dtype, const char* fn, F&& f) {
  if (dtype == 0) return f(Half{});
  if (dtype == 1) return f(BFloat16{});
  return Fail(cudaErrorInvalidValue, "%s: dtype %d is not float16 (0) or bfloat16 (1)", fn, dtype);
}

template <class L>
int CastToF32(const L& launch, int dtype, float* dst, const void* src, size_t count) {
  return WithHalfType(dtype, "bps_gpu_cast_to_f32", [&](auto tag) -> int {
    using E = decltype(tag);
    if (count == 0) return 0;
    if (!dst || !src) return Fail(cudaErrorInvalidValue, "bps_gpu_cast_to_f32: NULL buffer");
    Ptr ptrs[2] = {{dst, sizeof(float)}, {src, sizeof(uint16_t)}};
    return launch.Run(ToF32Op<E>{dst, src}, PlanSpan(ptrs, 2, count, ToF32Op<E>::kVec));
  });
}

template <class L>
int CastFromF32(const L& launch, int dtype, void* dst, const float* src, size_t count) {
  return WithHalfType(dtype, "bps_gpu_cast_from_f32", [&](auto tag) -> int {
    using E = decltype(tag);
    if (count == 0) return 0;
    if (!dst || !src) return Fail(cudaErrorInvalidValue, "bps_gpu_cast_from_f32: NULL buffer");
    Ptr ptrs[2] = {{dst, sizeof(uint16_t)}, {src, sizeof(float)}};
    return launch.Run(FromF32Op<E>{dst, src}, PlanSpan(ptrs, 2, count, FromF32Op<E>::kVec));
  });
}

DeviceLaunch OnStream(void* stream) { return DeviceLaunch{static_cast<cudaStream_t>(stream)}; }

}  // namespace

extern "C" {

int bps_gpu_sum(int dtype, void* dst, const void* const* srcs, int nsrcs, size_t count,
                void* stream) {
  return Sum(OnStream(stream), dtype, dst, srcs, nsrcs, count);
}

int bps_gpu_scale(int dtype, void* data, size_t count, double factor, void* stream) {
  return Scale(OnStream(stream), dtype, data, count, factor, "bps_gpu_scale");
}

int bps_gpu_average(int dtype, void* data, size_t count, int64_t n, void* stream) {
  return Average(OnStream(stream), dtype, data, count, n);
}

int bps_gpu_cast_to_f32(int dtype, float* dst, const void* src, size_t count, void* stream) {
  return CastToF32(OnStream(stream), dtype, dst, src, count);
}

int bps_gpu_cast_from_f32(int dtype, void* dst, const float* src, size_t count, void* stream) {
  return CastFromF32(OnStream(stream), dtype, dst, src, count);
}

const char* bps_gpu_last_error_string(void) { return g_last_error; }

#ifdef BPS_GPU_HOST_EMULATION
int bps_host_sum(int dtype, void* dst, const void* const* srcs, int nsrcs, size_t count, void*) {
  return Sum(HostLaunch{}, dtype, dst, srcs, nsrcs, count);
}
int bps_host_scale(int dtype, void* data, size_t count, double factor, void*) {
  return Scale(HostLaunch{}, dtype, data, count, factor, "bps_gpu_scale");
}
int bps_host_average(int dtype, void* data, size_t count, int64_t n, void*) {
  return Average(HostLaunch{}, dtype, data, count, n);
}
int bps_host_cast_to_f32(int dtype, float* dst, const void* src, size_t count, void*) {
  return CastToF32(HostLaunch{}, dtype, dst, src, count);
}
int bps_host_cast_from_f32(int dtype, void* dst, const float* src, size_t count, void*) {
  return CastFromF32(HostLaunch{}, dtype, dst, src, count);
}
#endif

}  // extern "C"
