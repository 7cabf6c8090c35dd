// TF1 graph rewrite: with the switch on (bps_tf.compat.v1.enable_graph_rewrite,
// which calls bps_graph_rewrite_configure), the priority pass first inserts a
// BytepsPushPull between every dense gradient and the optimizer op applying
// it, in graphs that TF1 sessions run (not function graphs: tf.function and
// Keras reduce through the strategy, the tape or DistributedOptimizer). A
// plain tf.compat.v1 training script then becomes data-parallel.
//
// Dense updates: every Apply*/ResourceApply* op whose gradient input is named
// `grad` or `delta` gets push_pull(grad) (times 1/workers when averaging).
// Sparse updates (*SparseApply*, and Scatter(Add|Sub) ops fed by a gradient)
// are refused with an error naming the op: a sum of zero-padded dense rows is
// not the exact gather they need, and skipping them would let the embedding
// tables drift apart silently. bps_tf.compat.v1.DistributedOptimizer gathers
// them exactly.
#include "graph_rewrite.h"

#include <atomic>
#include <cstring>
#include <set>
#include <string>
#include <vector>

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
std::atomic<bool> g_average{true};

bool StartsWith(const std::string& s, const char* prefix) {
  return s.compare(0, std::strlen(prefix), prefix) == 0;
}

const Edge* DataInput(const Node* n, int index) {
  for (const Edge* e : n->in_edges()) {
    if (!e->IsControlEdge() && e->dst_input() == index) return e;
  }
  return nullptr;
}

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
      "Identity", "Mul", "RealDiv", "Div", "FloorDiv", "Cast", "Neg", "Sub",
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

// Whether a value depends, within a few ops, on the output of tf.gradients
// (whose nodes live under a "gradients" name scope).
bool FromGradients(const Node* n, int depth = 0) {
  if (n->name() == "gradients" || StartsWith(n->name(), "gradients/") ||
      n->name().find("/gradients/") != std::string::npos) {
    return true;
  }
  if (depth >= 8) return false;
  for (const Edge* e : n->in_edges()) {
    if (!e->IsControlEdge() && FromGradients(e->src(), depth + 1)) return true;
  }
  return false;
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
  for (Node* n : g->op_nodes()) {
    if (IsSparseGradientUpdate(n)) {
      int values = ArgIndex(n, "grad") >= 0 ? ArgIndex(n, "grad") : ArgIndex(n, "updates");
      const Edge* grad = values >= 0 ? DataInput(n, values) : nullptr;
      if (grad && AlreadyReduced(grad->src())) continue;
      return absl::UnimplementedError(
          "bps_tf graph rewrite: " + n->name() + " (" + n->type_string() +
          ") applies a sparse gradient, which the graph rewrite does not reduce (it handles "
          "dense Apply*/ResourceApply* updates). Wrap the optimizer instead: "
          "bps_tf.DistributedOptimizer(tf.compat.v1.train.<Optimizer>(...)) gathers sparse "
          "gradients exactly.");
    }
    int index = GradInput(n);
    if (index < 0) continue;
    const Edge* grad = DataInput(n, index);
    if (!grad || AlreadyReduced(grad->src())) continue;
    targets.push_back({n, index});
  }
  std::set<std::string> names;
  const int workers = g_workers.load();
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
    Node* out = pp;
    if (g_average.load() && workers > 1) {
      tensorflow::Tensor scale(tensorflow::DT_FLOAT, tensorflow::TensorShape({}));
      scale.scalar<float>()() = 1.0f / static_cast<float>(workers);
      Node* c = nullptr;
      TF_RETURN_IF_ERROR(NodeBuilder(g->NewName(pp->name() + "/scale"), "Const")
                             .Attr("dtype", tensorflow::DT_FLOAT)
                             .Attr("value", scale)
                             .Device(device)
                             .Finalize(g, &c));
      if (dtype != tensorflow::DT_FLOAT) {
        Node* cast = nullptr;
        TF_RETURN_IF_ERROR(NodeBuilder(g->NewName(pp->name() + "/scale_cast"), "Cast")
                               .Input(c, 0)
                               .Attr("SrcT", tensorflow::DT_FLOAT)
                               .Attr("DstT", dtype)
                               .Device(device)
                               .Finalize(g, &cast));
        c = cast;
      }
      TF_RETURN_IF_ERROR(NodeBuilder(g->NewName(pp->name() + "/average"), "Mul")
                             .Input(pp, 0)
                             .Input(c, 0)
                             .Attr("T", dtype)
                             .Device(device)
                             .Finalize(g, &out));
    }
    TF_RETURN_IF_ERROR(g->UpdateEdge(out, 0, apply, index));
  }
  return absl::OkStatus();
}

}  // namespace bps_tf

extern "C" void bps_graph_rewrite_configure(int on, int num_workers, int average) {
  bps_tf::g_workers = num_workers > 0 ? num_workers : 1;
  bps_tf::g_average = average != 0;
  bps_tf::g_on = on != 0;
}
