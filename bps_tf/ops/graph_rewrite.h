// TF1 graph rewrite (push_pull insertion), run by the priority pass before it
// ranks priorities. See graph_rewrite.cc.
#ifndef BPS_TF_OPS_GRAPH_REWRITE_H_
#define BPS_TF_OPS_GRAPH_REWRITE_H_

#include "absl/status/status.h"

namespace tensorflow {
class Graph;
}

namespace bps_tf {
// No-op unless switched on and `g` is not a function graph.
absl::Status InsertPushPulls(tensorflow::Graph* g, bool is_function_graph);
}  // namespace bps_tf

extern "C" {
// on: insert push_pulls in TF1 session graphs from now on (this worker is
// `rank` of `num_workers`); the sum is multiplied by 1/num_workers when
// average is non-zero.
void bps_graph_rewrite_configure(int on, int num_workers, int rank, int average);
}

#endif  // BPS_TF_OPS_GRAPH_REWRITE_H_
