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
#include "gpu/gpu_reduce.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>

#define BPS_HD __host__ __device__ __forceinline__

namespace {

constexpr int kThreads = 256;
constexpr int kMaxSrcs = 16;   // sources per launch: keeps kernel parameters small
constexpr int kVecBytes = 16;  // one uint4 load or store

#include "gpu/gpu_reduce_ops.cuh"

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
    Ptr ptrs[2] = {{dst, sizeof(float)}, {src, sizeof(uint16_t), sizeof(uint2)}};
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
