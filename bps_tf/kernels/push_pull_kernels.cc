// CPU kernels of BytepsPushPull and BytepsBroadcast: they only translate TF
// tensors into the core's buffers and call `done` when the core finishes.
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bps_api.h"
#include "core_abi.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace bps_tf {

using tensorflow::AsyncOpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;

namespace {

// Everything one asynchronous call needs until the core calls back; holding
// the tensors keeps their buffers alive while the core reads and writes them.
struct Pending {
  OpKernelContext* ctx;
  AsyncOpKernel::DoneCallback done;
  Tensor input;
  Tensor output;
  Tensor zeros;
};

void OnDone(void* arg, int status, const char* error) {
  Pending* p = static_cast<Pending*>(arg);
  if (status != BPS_OK) p->ctx->SetStatus(EngineStatus(status, error));
  AsyncOpKernel::DoneCallback done = std::move(p->done);
  delete p;
  done();
}

void Enqueue(const std::string& name, int64_t priority, Pending* p, const void* src,
             const std::string& compression, const std::string& agreement, int reduce_op = 0) {
  std::vector<int64_t> shape;
  for (int i = 0; i < p->input.dims(); ++i) shape.push_back(p->input.dim_size(i));
  if (reduce_op != 0) {
    bps_enqueue_reduce(name.c_str(), CoreDType(p->input.dtype()), shape.data(),
                       static_cast<int>(shape.size()), src,
                       const_cast<char*>(p->output.tensor_data().data()), priority, reduce_op,
                       agreement.c_str(), &OnDone, p);
    return;
  }
  bps_enqueue_push_pull_ex(name.c_str(), CoreDType(p->input.dtype()), shape.data(),
                           static_cast<int>(shape.size()), src,
                           const_cast<char*>(p->output.tensor_data().data()), priority,
                           compression.c_str(), agreement.c_str(), &OnDone, p);
}

// The output buffer of one push_pull node, kept across steps. TensorFlow's
// CPU allocator gives a kernel fresh memory every step, and above glibc's
// mmap threshold copying the reply into it first-touches every page again,
// which costs as much as the transfer (docs/performance.md). A result is
// handed out again only while this kernel holds the one reference to it, so
// a result the program still holds (a Python variable, a list, a second
// output of the same function, a consumer still running) is never written.
class OutputBuffer {
 public:
  // Output 0 of `ctx`, of the input's dtype and shape: the input itself when
  // TensorFlow lets the kernel reuse it (the core allows in == out), else the
  // kept buffer when nobody else holds it, else a new one that is kept.
  tensorflow::Status Take(OpKernelContext* ctx, const Tensor& input, Tensor* out) {
    std::unique_ptr<Tensor> forwarded =
        ctx->forward_input(0, 0, input.dtype(), input.shape(), ctx->output_memory_type(0),
                           ctx->output_alloc_attr(0));
    if (forwarded) {
      ctx->set_output(0, *forwarded);
      *out = *forwarded;
      return tensorflow::Status();
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (!(kept_.dtype() == input.dtype() && kept_.shape() == input.shape() &&
          kept_.RefCountIsOne())) {
      Tensor fresh;
      tensorflow::Status s = ctx->allocate_temp(input.dtype(), input.shape(), &fresh,
                                                ctx->output_alloc_attr(0));
      if (!s.ok()) return s;
      kept_ = fresh;
    }
    ctx->set_output(0, kept_);
    *out = kept_;
    return tensorflow::Status();
  }

 private:
  std::mutex mu_;
  Tensor kept_;
};

}  // namespace

class PushPullOp : public AsyncOpKernel {
 public:
  explicit PushPullOp(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("tensor_name", &name_));
    OP_REQUIRES_OK(c, c->GetAttr("priority", &priority_));
    OP_REQUIRES_OK(c, c->GetAttr("compression", &compression_));
    OP_REQUIRES_OK(c, c->GetAttr("agreement", &agreement_));
    std::string op;
    OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &op));
    reduce_op_ = ReduceOpCode(op);
    OP_REQUIRES(c, reduce_op_ == 0 || compression_.empty() || compression_ == "none",
                tensorflow::errors::InvalidArgument("push_pull '", def().name(), "': reduce_op ",
                                                    op, " takes no compression"));
    if (name_.empty()) name_ = def().name();
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& input = ctx->input(0);
    Tensor output;
    OP_REQUIRES_OK_ASYNC(ctx, output_.Take(ctx, input, &output), done);
    Pending* p = new Pending{ctx, std::move(done), input, output, Tensor()};
    Enqueue(name_, priority_, p, input.tensor_data().data(), compression_, agreement_, reduce_op_);
  }

 private:
  std::string name_;
  std::string compression_;
  std::string agreement_;
  int reduce_op_ = 0;
  tensorflow::int64 priority_ = 0;
  OutputBuffer output_;
};

class BroadcastOp : public AsyncOpKernel {
 public:
  explicit BroadcastOp(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("tensor_name", &name_));
    OP_REQUIRES_OK(c, c->GetAttr("root_rank", &root_rank_));
    OP_REQUIRES_OK(c, c->GetAttr("priority", &priority_));
    OP_REQUIRES_OK(c, c->GetAttr("agreement", &agreement_));
    if (name_.empty()) name_ = def().name();
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& input = ctx->input(0);
    if (bps_is_initialized()) {
      OP_REQUIRES_ASYNC(ctx, root_rank_ >= 0 && root_rank_ < bps_size(),
                        tensorflow::errors::InvalidArgument(
                            "broadcast '", name_, "': root_rank ", root_rank_,
                            " is outside [0, ", bps_size(), ")"),
                        done);
    }
    Tensor* output = nullptr;
    OP_REQUIRES_OK_ASYNC(
        ctx, ctx->forward_input_or_allocate_output({0}, 0, input.shape(), &output), done);
    Pending* p = new Pending{ctx, std::move(done), input, *output, Tensor()};
    const void* src = input.tensor_data().data();
    // Broadcast is a sum in which every worker but the root adds zeros: exact
    // for every dtype, and it reuses the whole push_pull path.
    if (bps_is_initialized() && bps_rank() != root_rank_) {
      tensorflow::Status s = ctx->allocate_temp(input.dtype(), input.shape(), &p->zeros);
      if (!s.ok()) {
        ctx->SetStatus(s);
        DoneCallback d = std::move(p->done);
        delete p;
        d();
        return;
      }
      std::memset(const_cast<char*>(p->zeros.tensor_data().data()), 0,
                  p->zeros.tensor_data().size());
      src = p->zeros.tensor_data().data();
    }
    Enqueue(name_, priority_, p, src, "",
            JoinAgreement(BroadcastAgreement(root_rank_), agreement_));
  }

 private:
  std::string name_;
  std::string agreement_;
  tensorflow::int64 root_rank_ = 0;
  tensorflow::int64 priority_ = 0;
};

// Reads the membership when the graph runs, not when it was traced: an
// elastic job's size and ranks change under graphs that outlive them.
class MembershipOp : public tensorflow::OpKernel {
 public:
  explicit MembershipOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("query", &query_));
  }

  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES(ctx, bps_is_initialized(),
                tensorflow::errors::FailedPrecondition(
                    "bps_tf is not initialized: call bps_tf.init() before running a graph "
                    "that reads this worker's ", query_));
    int value = 0;
    if (query_ == "rank") value = bps_rank();
    else if (query_ == "size") value = bps_size();
    else if (query_ == "local_rank") value = bps_local_rank();
    else if (query_ == "local_size") value = bps_local_size();
    else if (query_ == "cross_rank") value = bps_cross_rank();
    else value = bps_cross_size();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tensorflow::TensorShape({}), &out));
    out->scalar<tensorflow::int32>()() = value;
  }

 private:
  std::string query_;
};

REGISTER_KERNEL_BUILDER(Name("BytepsPushPull").Device(tensorflow::DEVICE_CPU), PushPullOp);
REGISTER_KERNEL_BUILDER(Name("BytepsMembership").Device(tensorflow::DEVICE_CPU), MembershipOp);
REGISTER_KERNEL_BUILDER(Name("BytepsBroadcast").Device(tensorflow::DEVICE_CPU), BroadcastOp);

}  // namespace bps_tf
