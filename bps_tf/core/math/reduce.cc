#include "math/reduce.h"

#include <cstring>

#include "bps_api.h"

namespace bps {

namespace {
inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Integers are summed as unsigned so overflow wraps (as in TensorFlow)
// instead of being undefined. Plain loops over raw pointers that the compiler vectorises; memcpy-free so
// unaligned buffers (ZeroMQ frames) are fine on x86 and arm64.
template <typename T>
void SumTyped(void* dst, const void* src, size_t count) {
  T* __restrict d = static_cast<T*>(dst);
  const T* __restrict s = static_cast<const T*>(src);
  for (size_t i = 0; i < count; ++i) d[i] += s[i];
}

// Min, max and product. nan propagates (as numpy's minimum/maximum and
// TensorFlow's reduce_min/max do). Integer products wrap: computed unsigned.
struct MinOp {
  template <typename T>
  static T Apply(T a, T b) {
    if (a != a) return a;
    if (b != b) return b;
    return b < a ? b : a;
  }
};
struct MaxOp {
  template <typename T>
  static T Apply(T a, T b) {
    if (a != a) return a;
    if (b != b) return b;
    return a < b ? b : a;
  }
};
struct ProdOp {
  template <typename T>
  static T Apply(T a, T b) { return a * b; }
};

template <typename Op, typename T>
void ApplyTyped(void* dst, const void* src, size_t count) {
  T* __restrict d = static_cast<T*>(dst);
  const T* __restrict s = static_cast<const T*>(src);
  for (size_t i = 0; i < count; ++i) d[i] = Op::Apply(d[i], s[i]);
}

template <typename Op, float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void ApplyHalfLike(void* dst, const void* src, size_t count) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  const uint16_t* s = static_cast<const uint16_t*>(src);
  for (size_t i = 0; i < count; ++i) d[i] = FromFloat(Op::Apply(ToFloat(d[i]), ToFloat(s[i])));
}

template <typename Op>
void ApplyOp(int dtype, void* dst, const void* src, size_t count, bool wrap_ints) {
  switch (dtype) {
    case BPS_FLOAT16: ApplyHalfLike<Op, HalfToFloat, FloatToHalf>(dst, src, count); break;
    case BPS_BFLOAT16: ApplyHalfLike<Op, BFloat16ToFloat, FloatToBFloat16>(dst, src, count); break;
    case BPS_FLOAT32: ApplyTyped<Op, float>(dst, src, count); break;
    case BPS_FLOAT64: ApplyTyped<Op, double>(dst, src, count); break;
    case BPS_INT32:
      if (wrap_ints) ApplyTyped<Op, uint32_t>(dst, src, count);
      else ApplyTyped<Op, int32_t>(dst, src, count);
      break;
    case BPS_INT64:
      if (wrap_ints) ApplyTyped<Op, uint64_t>(dst, src, count);
      else ApplyTyped<Op, int64_t>(dst, src, count);
      break;
    default: break;
  }
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void SumHalfLike(void* dst, const void* src, size_t count) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  const uint16_t* s = static_cast<const uint16_t*>(src);
  for (size_t i = 0; i < count; ++i) d[i] = FromFloat(ToFloat(d[i]) + ToFloat(s[i]));
}
}  // namespace

float HalfToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  return BitsFloat(bits);
}

uint16_t FloatToHalf(float f) {
  uint32_t x = FloatBits(f);
  uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  uint32_t abs = x & 0x7fffffff;
  if (abs >= 0x7f800000) {  // inf or nan
    return sign | 0x7c00 | (abs > 0x7f800000 ? 0x200 : 0);
  }
  if (abs >= 0x477ff000) return sign | 0x7c00;  // rounds past the largest half
  int exp = static_cast<int>(abs >> 23) - 127 + 15;
  uint32_t mant = abs & 0x7fffff;
  if (exp <= 0) {  // subnormal half (or zero)
    if (exp < -10) return sign;
    mant |= 0x800000;
    int shift = 14 - exp;
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t half = (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;  // may carry into exp
  return sign | static_cast<uint16_t>(half);
}

float BFloat16ToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

uint16_t FloatToBFloat16(float f) {
  uint32_t x = FloatBits(f);
  if ((x & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet nan
  uint32_t rounding = 0x7fff + ((x >> 16) & 1);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

void SumInto(int dtype, void* dst, const void* src, size_t count) {
  switch (dtype) {
    case BPS_FLOAT16: SumHalfLike<HalfToFloat, FloatToHalf>(dst, src, count); break;
    case BPS_BFLOAT16: SumHalfLike<BFloat16ToFloat, FloatToBFloat16>(dst, src, count); break;
    case BPS_FLOAT32: SumTyped<float>(dst, src, count); break;
    case BPS_FLOAT64: SumTyped<double>(dst, src, count); break;
    case BPS_INT32: SumTyped<uint32_t>(dst, src, count); break;
    case BPS_INT64: SumTyped<uint64_t>(dst, src, count); break;
    default: break;
  }
}

void ReduceInto(int op, int dtype, void* dst, const void* src, size_t count) {
  switch (op) {
    case 1: ApplyOp<MinOp>(dtype, dst, src, count, false); break;
    case 2: ApplyOp<MaxOp>(dtype, dst, src, count, false); break;
    case 3: ApplyOp<ProdOp>(dtype, dst, src, count, true); break;
    default: SumInto(dtype, dst, src, count); break;
  }
}

}  // namespace bps
