// CPU sums used by the servers (and by workers for local reduction).
#ifndef BPS_TF_CORE_MATH_REDUCE_H_
#define BPS_TF_CORE_MATH_REDUCE_H_

#include <cstddef>
#include <cstdint>

namespace bps {

// dst[i] += src[i] for `count` elements of `dtype` (a bps_dtype value).
// float16 and bfloat16 are added in float32 and rounded to nearest even.
void SumInto(int dtype, void* dst, const void* src, size_t count);

// dst[i] = op(dst[i], src[i]) for a protocol.h ReduceOp (0 sum, 1 min,
// 2 max, 3 product), in the dtype's own arithmetic (integers wrap; halves
// computed in float32, rounded to nearest even). Min/max of floats follow
// IEEE fmin/fmax except that a nan in either operand gives nan.
void ReduceInto(int op, int dtype, void* dst, const void* src, size_t count);

float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

}  // namespace bps

#endif  // BPS_TF_CORE_MATH_REDUCE_H_
