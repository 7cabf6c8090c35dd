// The element types the core carries, in one table read by the engine, the
// Python module (numpy names) and the TensorFlow kernels (DataType values).
// Kept here, free of TensorFlow, so all three cannot drift apart. Header
// only: the op library includes it beside bps_api.h, and nothing else of the
// core (it must not depend on the core's C++ ABI).
#ifndef BPS_TF_CORE_DTYPES_H_
#define BPS_TF_CORE_DTYPES_H_

#include <cstddef>

#include "bps_api.h"

namespace bps {

struct DTypeInfo {
  int code;          // bps_dtype: travels on the wire
  const char* name;  // numpy's name, also used in messages and signatures
  size_t size;
  // tensorflow::DataType from types.proto; protobuf never renumbers values,
  // and the kernels check these at compile time.
  int tf_type;
};

inline constexpr DTypeInfo kDTypes[] = {
    {BPS_FLOAT16, "float16", 2, 19},  {BPS_BFLOAT16, "bfloat16", 2, 14},
    {BPS_FLOAT32, "float32", 4, 1},   {BPS_FLOAT64, "float64", 8, 2},
    {BPS_INT32, "int32", 4, 3},       {BPS_INT64, "int64", 8, 9},
};

constexpr const DTypeInfo* FindDType(int code) {
  for (const DTypeInfo& d : kDTypes) {
    if (d.code == code) return &d;
  }
  return nullptr;
}

// -1 for a TensorFlow type the core does not carry.
constexpr int DTypeFromTf(int tf_type) {
  for (const DTypeInfo& d : kDTypes) {
    if (d.tf_type == tf_type) return d.code;
  }
  return -1;
}

inline bool ValidDType(int code) { return FindDType(code) != nullptr; }
inline size_t DTypeSize(int code) {  // 0 for an unknown type
  const DTypeInfo* d = FindDType(code);
  return d ? d->size : 0;
}
inline const char* DTypeName(int code) {
  const DTypeInfo* d = FindDType(code);
  return d ? d->name : "unknown";
}

}  // namespace bps

#endif  // BPS_TF_CORE_DTYPES_H_
