// The TensorFlow side of the core's C ABI, shared by the CPU and GPU kernels:
// TF dtypes to bps_dtype codes (from the core's one table, dtypes.h) and
// bps_status codes to TF error types.
#ifndef BPS_TF_KERNELS_CORE_ABI_H_
#define BPS_TF_KERNELS_CORE_ABI_H_

#include <string>

#include "bps_api.h"
#include "dtypes.h"
#include "tensorflow/core/framework/types.pb.h"
#include "tensorflow/core/platform/errors.h"
#include "tensorflow/core/platform/status.h"

namespace bps_tf {

// The core's table names TF types by number; a wrong number fails the build.
static_assert(bps::DTypeFromTf(tensorflow::DT_HALF) == BPS_FLOAT16, "dtypes.h: DT_HALF");
static_assert(bps::DTypeFromTf(tensorflow::DT_BFLOAT16) == BPS_BFLOAT16, "dtypes.h: DT_BFLOAT16");
static_assert(bps::DTypeFromTf(tensorflow::DT_FLOAT) == BPS_FLOAT32, "dtypes.h: DT_FLOAT");
static_assert(bps::DTypeFromTf(tensorflow::DT_DOUBLE) == BPS_FLOAT64, "dtypes.h: DT_DOUBLE");
static_assert(bps::DTypeFromTf(tensorflow::DT_INT32) == BPS_INT32, "dtypes.h: DT_INT32");
static_assert(bps::DTypeFromTf(tensorflow::DT_INT64) == BPS_INT64, "dtypes.h: DT_INT64");

// What a broadcast declares beside its shape: workers that disagree on the
// root fail at once, naming both roots, instead of summing two "roots".
inline std::string BroadcastAgreement(int64_t root_rank) {
  return "root=" + std::to_string(root_rank);
}

// The agreement text a kernel passes: its own part and the op's attr.
inline std::string JoinAgreement(const std::string& own, const std::string& attr) {
  if (own.empty()) return attr;
  return attr.empty() ? own : own + " " + attr;
}

// The op attr reduce_op ('sum', 'min', 'max', 'product') as the code
// bps_enqueue_reduce takes (protocol.h ReduceOp); the attr's allowed values
// make anything else impossible.
inline int ReduceOpCode(const std::string& op) {
  if (op == "min") return 1;
  if (op == "max") return 2;
  if (op == "product") return 3;
  return 0;
}

// -1 for a dtype the core does not carry (the op registrations exclude them).
inline int CoreDType(tensorflow::DataType dt) { return bps::DTypeFromTf(static_cast<int>(dt)); }

inline tensorflow::Status EngineStatus(int status, const char* error) {
  std::string message = error ? error : "unknown error";
  switch (status) {
    case BPS_OK: return tensorflow::Status();
    case BPS_ERR_NOT_INITIALIZED: return tensorflow::errors::FailedPrecondition(message);
    case BPS_ERR_INVALID: return tensorflow::errors::InvalidArgument(message);
    case BPS_ERR_MISMATCH: return tensorflow::errors::FailedPrecondition(message);
    case BPS_ERR_TIMEOUT: return tensorflow::errors::DeadlineExceeded(message);
    case BPS_ERR_INTERNAL: return tensorflow::errors::Internal(message);
    default: return tensorflow::errors::Unavailable(message);
  }
}

}  // namespace bps_tf

#endif  // BPS_TF_KERNELS_CORE_ABI_H_
