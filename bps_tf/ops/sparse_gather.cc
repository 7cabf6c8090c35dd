// The exact gather of a sparse gradient, built into a TF1 graph by the graph
// rewrite (graph_rewrite.cc): the IndexedSlices that tf.gradients produced
// (values, indices) are replaced, for every optimizer op that uses them, by
// the concatenation of all workers' rows in rank order, so the optimizer
// (its de-duplication, Adam's squares, ...) sees what one process would have
// seen on the concatenated batches.
//
// Per tensor X (values, then indices), with this worker's rank r of N:
//   rows   = shape(X)[0]
//   counts = push_pull(onehot(r) * rows)             every worker's row count
//   offset = sum(counts[:r]), total = sum(counts)
//   data   = scatter_nd(offset + range(rows), X, [total] + shape(X)[1:])
//   gather = push_pull(data)                         zero rows elsewhere: a sum is a concat
#include "sparse_gather.h"

#include <string>
#include <vector>

#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/graph/graph.h"
#include "tensorflow/core/graph/node_builder.h"

namespace bps_tf {
namespace {

using tensorflow::DataType;
using tensorflow::Graph;
using tensorflow::Node;
using tensorflow::NodeBuilder;
using tensorflow::Tensor;
using tensorflow::TensorShape;

class Builder {
 public:
  Builder(Graph* g, const std::string& scope, const std::string& device)
      : g_(g), scope_(scope), device_(device) {}

  absl::Status status() const { return status_; }

  Node* Op(const std::string& type, std::vector<Node*> inputs,
           std::vector<std::pair<std::string, tensorflow::AttrValue>> attrs) {
    if (!status_.ok()) return nullptr;
    NodeBuilder b(g_->NewName(scope_ + "/" + type), type);
    for (Node* in : inputs) b.Input(in, 0);
    for (auto& a : attrs) b.Attr(a.first, a.second);
    b.Device(device_);
    Node* n = nullptr;
    status_ = b.Finalize(g_, &n);
    return n;
  }

  // ConcatV2 takes its values as one list input.
  Node* Concat(const std::vector<Node*>& parts, Node* axis) {
    if (!status_.ok()) return nullptr;
    std::vector<NodeBuilder::NodeOut> list;
    for (Node* p : parts) list.emplace_back(p, 0);
    NodeBuilder b(g_->NewName(scope_ + "/ConcatV2"), "ConcatV2");
    b.Input(list).Input(axis, 0).Device(device_);
    Node* n = nullptr;
    status_ = b.Finalize(g_, &n);
    return n;
  }

  Node* ConstI64(const std::vector<int64_t>& values, bool scalar = false) {
    Tensor t(tensorflow::DT_INT64,
             scalar ? TensorShape({}) : TensorShape({static_cast<int64_t>(values.size())}));
    for (size_t i = 0; i < values.size(); ++i) t.flat<int64_t>()(i) = values[i];
    return Const(t);
  }

  Node* ConstI32(int32_t value) {
    Tensor t(tensorflow::DT_INT32, TensorShape({}));
    t.scalar<int32_t>()() = value;
    return Const(t);
  }

  Node* Const(const Tensor& t) {
    return Op("Const", {}, {{"dtype", Attr(t.dtype())}, {"value", Attr(t)}});
  }

  template <typename T>
  static tensorflow::AttrValue Attr(const T& v) {
    tensorflow::AttrValue a;
    tensorflow::SetAttrValue(v, &a);
    return a;
  }

 private:
  Graph* g_;
  std::string scope_;
  std::string device_;
  absl::Status status_;
};

tensorflow::AttrValue T(DataType d) { return Builder::Attr(d); }

}  // namespace

absl::Status BuildGather(Graph* g, Node* src, int src_output, DataType dtype,
                         const std::string& tensor_name, int rank, int size,
                         const std::string& device, Node** out) {
  Builder b(g, src->name() + "/bps_gather", device);
  // X as a node of its own (Identity), so every later op takes output 0.
  Node* x = nullptr;
  {
    NodeBuilder nb(g->NewName(src->name() + "/bps_gather/input"), "Identity");
    nb.Input(src, src_output).Attr("T", dtype).Device(device);
    TF_RETURN_IF_ERROR(nb.Finalize(g, &x));
  }
  const auto i64 = T(tensorflow::DT_INT64);
  Node* shape = b.Op("Shape", {x}, {{"T", T(dtype)}, {"out_type", i64}});
  Node* rows = b.Op("StridedSlice", {shape, b.ConstI64({0}), b.ConstI64({1}), b.ConstI64({1})},
                    {{"T", i64}, {"Index", i64}, {"shrink_axis_mask", Builder::Attr(1)}});
  std::vector<int64_t> onehot(size, 0), before(size, 0);
  onehot[rank] = 1;
  for (int i = 0; i < rank; ++i) before[i] = 1;
  Node* slots = b.Op("Mul", {b.ConstI64(onehot), rows}, {{"T", i64}});
  Node* counts = b.Op("BytepsPushPull", {slots},
                      {{"T", i64}, {"tensor_name", Builder::Attr(tensor_name + "/counts")},
                       {"priority", Builder::Attr(static_cast<int64_t>(0))}});
  const auto sum_attrs = std::vector<std::pair<std::string, tensorflow::AttrValue>>{
      {"T", i64}, {"Tidx", T(tensorflow::DT_INT32)}};
  Node* total = b.Op("Sum", {counts, b.ConstI32(0)}, sum_attrs);
  Node* offset = b.Op("Sum", {b.Op("Mul", {counts, b.ConstI64(before)}, {{"T", i64}}),
                              b.ConstI32(0)},
                      sum_attrs);
  Node* end = b.Op("AddV2", {offset, rows}, {{"T", i64}});
  Node* range = b.Op("Range", {offset, end, b.ConstI64({1}, true)}, {{"Tidx", i64}});
  Node* where = b.Op("ExpandDims", {range, b.ConstI32(-1)},
                     {{"T", i64}, {"Tdim", T(tensorflow::DT_INT32)}});
  Node* inner = b.Op("StridedSlice", {shape, b.ConstI64({1}), b.ConstI64({0}), b.ConstI64({1})},
                     {{"T", i64}, {"Index", i64}, {"end_mask", Builder::Attr(1)}});
  Node* total1 = b.Op("Reshape", {total, b.ConstI64({1})}, {{"T", i64}, {"Tshape", i64}});
  Node* full = b.Concat({total1, inner}, b.ConstI32(0));
  Node* data = b.Op("ScatterNd", {where, x, full}, {{"T", T(dtype)}, {"Tindices", i64}});
  *out = b.Op("BytepsPushPull", {data},
              {{"T", T(dtype)}, {"tensor_name", Builder::Attr(tensor_name + "/data")},
               {"priority", Builder::Attr(static_cast<int64_t>(0))}});
  return b.status();
}

}  // namespace bps_tf
