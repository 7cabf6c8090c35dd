// Small graph helpers shared by the two graph passes: the priority pass
// (priority_pass.cc) and the TF1 push_pull insertion (graph_rewrite.cc).
#ifndef BPS_TF_OPS_GRAPH_UTIL_H_
#define BPS_TF_OPS_GRAPH_UTIL_H_

#include <cstring>
#include <string>

#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/graph/graph.h"

namespace bps_tf {

inline bool StartsWith(const std::string& s, const char* prefix) {
  return s.compare(0, std::strlen(prefix), prefix) == 0;
}

// The edge that feeds data input `index` of `n`, or null.
inline const tensorflow::Edge* DataInput(const tensorflow::Node* n, int index) {
  for (const tensorflow::Edge* e : n->in_edges()) {
    if (!e->IsControlEdge() && e->dst_input() == index) return e;
  }
  return nullptr;
}

// Integer and boolean element types (counts, indices, masks).
inline bool IsIntegral(tensorflow::DataType d) {
  return d == tensorflow::DT_INT32 || d == tensorflow::DT_INT64 || d == tensorflow::DT_INT16 ||
         d == tensorflow::DT_INT8 || d == tensorflow::DT_UINT8 || d == tensorflow::DT_UINT32 ||
         d == tensorflow::DT_UINT64 || d == tensorflow::DT_UINT16 || d == tensorflow::DT_BOOL;
}

}  // namespace bps_tf

#endif  // BPS_TF_OPS_GRAPH_UTIL_H_
