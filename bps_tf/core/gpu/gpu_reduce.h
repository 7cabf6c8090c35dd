// Local reduction on the GPU, as a C ABI with no TensorFlow inside.
//
// The kernels live in gpu_reduce.cu, which includes only CUDA headers: it
// compiles in seconds (TensorFlow's headers under nvcc take 40-60 s), and the
// same object serves the TF GPU kernel, the standalone libbps_gpu_reduce.so
// and the ctypes harness in tests/gpu/.
//
// Every function enqueues its work on `stream` (a cudaStream_t; NULL is the
// legacy default stream) and returns at once with a cudaError_t value:
// 0 (cudaSuccess) when the work was enqueued. On failure,
// bps_gpu_last_error_string() says why, for the calling thread.
//
// dtype is a bps_dtype value (bps_tf/core/bps_api.h): 0 float16, 1 bfloat16,
// 2 float32, 3 float64, 4 int32, 5 int64. Buffers may have any size
// (including 0) and any address, even one that is not a multiple of the
// element size; naturally aligned buffers take the fast, vectorised path.
#ifndef BPS_TF_KERNELS_GPU_REDUCE_H_
#define BPS_TF_KERNELS_GPU_REDUCE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// dst[i] = srcs[0][i] + ... + srcs[nsrcs-1][i] for i < count. `srcs` is a
// host array of device pointers. dst may be srcs[0] (summing in place);
// otherwise it must not overlap any source. float16 and bfloat16 accumulate
// in float32 and round once to nearest even (per group of 16 sources);
// integers wrap on overflow. nsrcs == 0 writes zeros.
int bps_gpu_sum(int dtype, void* dst, const void* const* srcs, int nsrcs,
                size_t count, void* stream);

// data[i] *= factor, in place, for the floating-point dtypes (float16 and
// bfloat16 compute in float32, float32 in float32, float64 in float64).
// Integer dtypes are refused: use bps_gpu_average.
int bps_gpu_scale(int dtype, void* data, size_t count, double factor,
                  void* stream);

// Turns a sum of n values into their mean, in place: floating dtypes are
// multiplied by 1/n (as bps_gpu_scale); integer dtypes are divided by n
// rounding toward minus infinity, like numpy's `//`. n must not be 0.
int bps_gpu_average(int dtype, void* data, size_t count, int64_t n,
                    void* stream);

// float16/bfloat16 -> float32 and back (round to nearest even). dtype must
// be 0 or 1; dst and src must not overlap.
int bps_gpu_cast_to_f32(int dtype, float* dst, const void* src, size_t count,
                        void* stream);
int bps_gpu_cast_from_f32(int dtype, void* dst, const float* src,
                          size_t count, void* stream);

// Why the last failing call of this thread failed; "" if none did.
const char* bps_gpu_last_error_string(void);

#ifdef BPS_GPU_HOST_EMULATION
// Test-only twins of the functions above (built by tests/test_gpu.py with
// -DBPS_GPU_HOST_EMULATION): they run the very same per-thread code on the
// CPU over host buffers, emulating a small odd-sized grid, so the indexing
// (head/vector body/tail, aliasing, misalignment) is checked without a GPU.
int bps_host_sum(int dtype, void* dst, const void* const* srcs, int nsrcs,
                 size_t count, void* unused_stream);
int bps_host_scale(int dtype, void* data, size_t count, double factor,
                   void* unused_stream);
int bps_host_average(int dtype, void* data, size_t count, int64_t n,
                     void* unused_stream);
int bps_host_cast_to_f32(int dtype, float* dst, const void* src,
                         size_t count, void* unused_stream);
int bps_host_cast_from_f32(int dtype, void* dst, const float* src,
                           size_t count, void* unused_stream);
#endif

#ifdef __cplusplus
}
#endif

#endif  // BPS_TF_KERNELS_GPU_REDUCE_H_
