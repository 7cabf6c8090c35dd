// Builds the exact gather of one tensor's rows across workers into a graph
// (see sparse_gather.cc); used by the TF1 graph rewrite for sparse gradients.
#ifndef BPS_TF_OPS_SPARSE_GATHER_H_
#define BPS_TF_OPS_SPARSE_GATHER_H_

#include <string>

#include "absl/status/status.h"
#include "tensorflow/core/framework/types.pb.h"

namespace tensorflow {
class Graph;
class Node;
}  // namespace tensorflow

namespace bps_tf {
// *out: a node whose output 0 holds the rows of (src, src_output) of every
// worker, in rank order. Push_pulls named <tensor_name>/counts and /data.
absl::Status BuildGather(tensorflow::Graph* g, tensorflow::Node* src, int src_output,
                         tensorflow::DataType dtype, const std::string& tensor_name, int rank,
                         int size, const std::string& device, tensorflow::Node** out);
}  // namespace bps_tf

#endif  // BPS_TF_OPS_SPARSE_GATHER_H_
