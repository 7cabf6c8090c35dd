// TensorFlow dtype -> the core's bps_dtype code, shared by the CPU and GPU kernels.
#ifndef BPS_TF_KERNELS_DTYPE_MAP_H_
#define BPS_TF_KERNELS_DTYPE_MAP_H_

#include "bps_api.h"
#include "tensorflow/core/framework/types.pb.h"

namespace bps_tf {

// -1 for a dtype the core does not carry (the op registrations exclude them).
inline int CoreDType(tensorflow::DataType dt) {
  switch (dt) {
    case tensorflow::DT_HALF: return BPS_FLOAT16;
    case tensorflow::DT_BFLOAT16: return BPS_BFLOAT16;
    case tensorflow::DT_FLOAT: return BPS_FLOAT32;
    case tensorflow::DT_DOUBLE: return BPS_FLOAT64;
    case tensorflow::DT_INT32: return BPS_INT32;
    case tensorflow::DT_INT64: return BPS_INT64;
    default: return -1;
  }
}

}  // namespace bps_tf

#endif  // BPS_TF_KERNELS_DTYPE_MAP_H_
