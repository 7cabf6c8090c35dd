// CPU sums used by the servers (and by workers for local reduction).
#ifndef BPS_TF_CORE_REDUCE_H_
#define BPS_TF_CORE_REDUCE_H_

#include <cstddef>
#include <cstdint>

namespace bps {

// dst[i] += src[i] for `count` elements of `dtype` (a bps_dtype value).
// float16 and bfloat16 are added in float32 and rounded to nearest even.
void SumInto(int dtype, void* dst, const void* src, size_t count);

float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

}  // namespace bps

#endif  // BPS_TF_CORE_REDUCE_H_
