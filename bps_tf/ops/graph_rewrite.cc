// TF1 graph rewrite: with the switch on (bps_tf.compat.v1.enable_graph_rewrite,
// which calls bps_graph_rewrite_configure), the priority pass first inserts a
// BytepsPushPull between every dense gradient and the optimizer op applying
// it, in graphs that TF1 sessions run (not function graphs: tf.function and
// Keras reduce through the strategy, the tape or DistributedOptimizer). A
// plain tf.compat.v1 training script then becomes data-parallel.
//
// Dense updates: every Apply*/ResourceApply* op whose gradient input is named
// `grad` or `delta` gets push_pull(grad) (times 1/workers when averaging).
// Sparse updates (*SparseApply*, and Scatter(Add|Sub) ops fed by a gradient):
// the IndexedSlices tf.gradients produced (values, indices) are traced back
// from the update through the optimizer's own ops (its de-duplication, Adam's
// scaling and squares) and replaced, for every optimizer op, by the exact
// gather of all workers' rows (sparse_gather.cc). An update that cannot be
// traced that way is refused with an error naming the op, never skipped:
// skipping would let the embedding tables drift apart silently.
#include "graph_rewrite.h"

#include <atomic>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "graph_util.h"
#include "sparse_gather.h"
#include "tensorflow/core/framework/op_def.pb.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/graph/graph.h"
#include "tensorflow/core/graph/node_builder.h"

namespace bps_tf {
namespace {

using tensorflow::DataType;
using tensorflow::Edge;
using tensorflow::Graph;
using tensorflow::Node;
using tensorflow::NodeBuilder;

std::atomic<bool> g_on{false};
std::atomic<int> g_workers{1};
std::atomic<int> g_rank{0};
std::atomic<bool> g_average{true};

// Index of the dense gradient input of an optimizer op, or -1.
int GradInput(const Node* n) {
  const std::string& t = n->type_string();
  if (!StartsWith(t, "Apply") && !StartsWith(t, "ResourceApply")) return -1;
  const tensorflow::OpDef& def = n->op_def();
  for (const auto& arg : def.input_arg()) {
    if (!arg.number_attr().empty() || !arg.type_list_attr().empty()) return -1;
  }
  for (const char* wanted : {"grad", "delta"}) {
    for (int i = 0; i < def.input_arg_size(); ++i) {
      if (def.input_arg(i).name() == wanted) return i;
    }
  }
  return -1;
}

// Whether `n`'s value comes (a few forwarding or scaling ops back) from a
// push_pull already: rewritten before, or reduced by DistributedOptimizer.
bool AlreadyReduced(const Node* n, int depth = 0) {
  const std::string& t = n->type_string();
  if (t == "BytepsPushPull") return true;
  static const std::set<std::string>* forwarding = new std::set<std::string>{
      "Identity", "Mul", "RealDiv", "Div", "FloorDiv", "Cast", "Neg", "Sub", "Square",
      "UnsortedSegmentSum", "GatherV2", "Reshape"};
  if (depth >= 8 || !forwarding->count(t)) return false;
  for (const Edge* e : n->in_edges()) {
    if (!e->IsControlEdge() && AlreadyReduced(e->src(), depth + 1)) return true;
  }
  return false;
}

// Index of the input argument called `name`, or -1.
int ArgIndex(const Node* n, const char* name) {
  const tensorflow::OpDef& def = n->op_def();
  for (int i = 0; i < def.input_arg_size(); ++i) {
    if (def.input_arg(i).name() == name) return i;
  }
  return -1;
}

// Whether a node belongs to tf.gradients' output: a "gradients" (or
// "gradients_<k>") component in its name scope.
bool InGradients(const std::string& name) {
  size_t start = 0;
  while (true) {
    size_t slash = name.find('/', start);
    if (slash == std::string::npos) return false;
    std::string part = name.substr(start, slash - start);
    if (part == "gradients") return true;
    if (StartsWith(part, "gradients_") && part.size() > 10 &&
        part.find_first_not_of("0123456789", 10) == std::string::npos) {
      return true;
    }
    start = slash + 1;
  }
}

// Whether a value depends, within a few ops, on the output of tf.gradients.
bool FromGradients(const Node* n, int depth = 0) {
  if (InGradients(n->name())) return true;
  if (depth >= 8) return false;
  for (const Edge* e : n->in_edges()) {
    if (!e->IsControlEdge() && FromGradients(e->src(), depth + 1)) return true;
  }
  return false;
}

// The dtypes sparse indices come in: TraceToGradient tells a gradient's
// indices from its values by it. Narrower than IsIntegral (graph_util.h).
bool IsIndexDType(DataType d) {
  return d == tensorflow::DT_INT32 || d == tensorflow::DT_INT64;
}

// The tf.gradients output tensor an optimizer input comes from, through the
// optimizer's elementwise, de-duplication (Unique, UnsortedSegmentSum) and
// forwarding ops; `integral` picks the indices (else the values).
bool TraceToGradient(Node* n, int output, bool integral, Node** src, int* src_output,
                     int depth = 0) {
  if (InGradients(n->name())) {
    *src = n;
    *src_output = output;
    return true;
  }
  static const std::set<std::string>* elementwise = new std::set<std::string>{
      "Identity", "Cast", "Neg", "Square", "Mul", "RealDiv", "Sub", "AddV2", "Sqrt",
      "Reshape"};
  const std::string& t = n->type_string();
  int only = -1;
  if (t == "UnsortedSegmentSum" || t == "Unique") {
    only = 0;
  } else if (!elementwise->count(t)) {
    return false;
  }
  if (depth >= 12) return false;
  for (const Edge* e : n->in_edges()) {
    if (e->IsControlEdge() || (only >= 0 && e->dst_input() != only)) continue;
    if (IsIndexDType(e->src()->output_type(e->src_output())) != integral) continue;
    if (TraceToGradient(e->src(), e->src_output(), integral, src, src_output, depth + 1)) {
      return true;
    }
  }
  return false;
}

// Multiplies `in` by 1/workers (in `dtype`) when averaging; else returns it.
absl::Status Averaged(Graph* g, Node* in, DataType dtype, const std::string& device,
                      Node** out) {
  *out = in;
  const int workers = g_workers.load();
  if (!g_average.load() || workers <= 1) return absl::OkStatus();
  tensorflow::Tensor scale(tensorflow::DT_FLOAT, tensorflow::TensorShape({}));
  scale.scalar<float>()() = 1.0f / static_cast<float>(workers);
  Node* c = nullptr;
  TF_RETURN_IF_ERROR(NodeBuilder(g->NewName(in->name() + "/scale"), "Const")
                         .Attr("dtype", tensorflow::DT_FLOAT)
                         .Attr("value", scale)
                         .Device(device)
                         .Finalize(g, &c));
  if (dtype != tensorflow::DT_FLOAT) {
    Node* cast = nullptr;
    TF_RETURN_IF_ERROR(NodeBuilder(g->NewName(in->name() + "/scale_cast"), "Cast")
                           .Input(c, 0)
                           .Attr("SrcT", tensorflow::DT_FLOAT)
                           .Attr("DstT", dtype)
                           .Device(device)
                           .Finalize(g, &cast));
    c = cast;
  }
  return NodeBuilder(g->NewName(in->name() + "/average"), "Mul")
      .Input(in, 0)
      .Input(c, 0)
      .Attr("T", dtype)
      .Device(device)
      .Finalize(g, out);
}

struct TensorRef {
  Node* node;
  int output;
  bool operator<(const TensorRef& o) const {
    return node->id() != o.node->id() ? node->id() < o.node->id() : output < o.output;
  }
};

// Replaces, for every consumer outside tf.gradients' scope, a sparse
// gradient's values and indices by their gather across workers.
absl::Status GatherSparse(Graph* g, TensorRef values, TensorRef indices) {
  auto consumers = [](TensorRef t) {
    std::vector<std::pair<Node*, int>> out;
    for (const Edge* e : t.node->out_edges()) {
      if (!e->IsControlEdge() && e->src_output() == t.output && !InGradients(e->dst()->name())) {
        out.push_back({e->dst(), e->dst_input()});
      }
    }
    return out;
  };
  auto value_users = consumers(values);
  auto index_users = consumers(indices);
  std::string name = "graph_rewrite/" + values.node->name();
  if (values.output) name += ":" + std::to_string(values.output);
  const std::string& device = values.node->requested_device();
  DataType vtype = values.node->output_type(values.output);
  DataType itype = indices.node->output_type(indices.output);
  Node *gv = nullptr, *gi = nullptr, *avg = nullptr;
  TF_RETURN_IF_ERROR(BuildGather(g, values.node, values.output, vtype, name + "/values",
                                 g_rank.load(), g_workers.load(), device, &gv));
  TF_RETURN_IF_ERROR(BuildGather(g, indices.node, indices.output, itype, name + "/indices",
                                 g_rank.load(), g_workers.load(), device, &gi));
  TF_RETURN_IF_ERROR(Averaged(g, gv, vtype, device, &avg));
  for (const auto& [dst, input] : value_users) {
    TF_RETURN_IF_ERROR(g->UpdateEdge(avg, 0, dst, input));
  }
  for (const auto& [dst, input] : index_users) {
    TF_RETURN_IF_ERROR(g->UpdateEdge(gi, 0, dst, input));
  }
  return absl::OkStatus();
}

bool IsSparseGradientUpdate(const Node* n) {
  const std::string& t = n->type_string();
  if (t.find("SparseApply") != std::string::npos) return true;
  if (t == "ResourceScatterAdd" || t == "ResourceScatterSub" || t == "ScatterAdd" ||
      t == "ScatterSub") {
    const Edge* updates = DataInput(n, 2);
    return updates && FromGradients(updates->src());
  }
  return false;
}

// The variable an optimizer op updates: input 0, looked back through Identity.
std::string VariableName(const Node* apply) {
  const Edge* e = DataInput(apply, 0);
  const Node* n = e ? e->src() : apply;
  for (int hops = 0; hops < 8; ++hops) {
    if (n->type_string() != "Identity" && n->type_string() != "RefIdentity") break;
    const Edge* in = DataInput(n, 0);
    if (!in) break;
    n = in->src();
  }
  return n->name();
}

}  // namespace

absl::Status InsertPushPulls(Graph* g, bool is_function_graph) {
  if (!g_on.load() || is_function_graph) return absl::OkStatus();
  std::vector<std::pair<Node*, int>> targets;
  std::set<std::pair<TensorRef, TensorRef>> sparse;
  for (Node* n : g->op_nodes()) {
    if (IsSparseGradientUpdate(n)) {
      int v = ArgIndex(n, "grad") >= 0 ? ArgIndex(n, "grad") : ArgIndex(n, "updates");
      int i = ArgIndex(n, "indices");
      const Edge* ve = v >= 0 ? DataInput(n, v) : nullptr;
      const Edge* ie = i >= 0 ? DataInput(n, i) : nullptr;
      if (ve && AlreadyReduced(ve->src())) continue;
      TensorRef values{nullptr, 0}, indices{nullptr, 0};
      if (ve && ie &&
          TraceToGradient(ve->src(), ve->src_output(), false, &values.node, &values.output) &&
          TraceToGradient(ie->src(), ie->src_output(), true, &indices.node, &indices.output)) {
        sparse.insert({values, indices});
        continue;
      }
      return absl::UnimplementedError(
          "bps_tf graph rewrite: " + n->name() + " (" + n->type_string() +
          ") applies a sparse gradient that cannot be traced back to tf.gradients' "
          "IndexedSlices, so it cannot be gathered across workers. Wrap the optimizer "
          "instead: bps_tf.DistributedOptimizer(tf.compat.v1.train.<Optimizer>(...)) gathers "
          "sparse gradients exactly.");
    }
    int index = GradInput(n);
    if (index < 0) continue;
    const Edge* grad = DataInput(n, index);
    if (!grad || AlreadyReduced(grad->src())) continue;
    targets.push_back({n, index});
  }
  for (const auto& [values, indices] : sparse) {
    TF_RETURN_IF_ERROR(GatherSparse(g, values, indices));
  }
  std::set<std::string> names;
  for (const auto& [apply, index] : targets) {
    const Edge* grad = DataInput(apply, index);
    Node* src = grad->src();
    int src_output = grad->src_output();
    DataType dtype = tensorflow::BaseType(apply->input_type(index));
    std::string name = "graph_rewrite/" + VariableName(apply);
    for (int k = 1; !names.insert(name).second; ++k) {
      name = "graph_rewrite/" + VariableName(apply) + "_" + std::to_string(k);
    }
    const std::string& device = apply->requested_device();
    Node* pp = nullptr;
    TF_RETURN_IF_ERROR(NodeBuilder(g->NewName(src->name() + "/BytepsPushPull"), "BytepsPushPull")
                           .Input(src, src_output)
                           .Attr("T", dtype)
                           .Attr("tensor_name", name)
                           .Attr("priority", static_cast<int64_t>(0))
                           .Device(device)
                           .Finalize(g, &pp));
    Node* out = nullptr;
    TF_RETURN_IF_ERROR(Averaged(g, pp, dtype, device, &out));
    TF_RETURN_IF_ERROR(g->UpdateEdge(out, 0, apply, index));
  }
  return absl::OkStatus();
}

}  // namespace bps_tf

extern "C" void bps_graph_rewrite_configure(int on, int num_workers, int rank, int average) {
  bps_tf::g_workers = num_workers > 0 ? num_workers : 1;
  bps_tf::g_rank = rank >= 0 && rank < bps_tf::g_workers ? rank : 0;
  bps_tf::g_average = average != 0;
  bps_tf::g_on = on != 0;
}
