// GPU kernels of BytepsPushPull and BytepsBroadcast (built only with
// -DGOOGLE_CUDA=1, by setup.py through tools/build_gpu.py).
//
// One call, all on the op's CUDA stream:
//   1. several inputs: sum them on the device (core/gpu/gpu_reduce.h) into the output;
//   2. copy device -> pinned host buffer;
//   3. when the stream reaches that point, hand the host buffer to the engine
//      (bps_enqueue_push_pull sums it across workers in place);
//   4. when the engine is done, copy host -> output on the same stream and
//      call `done`. Later kernels on the stream see the result; the host
//      buffer is released only once the copy has finished.
// `done` is called exactly once on every path. CUDA forbids CUDA calls inside
// stream callbacks, and TF's `done` may launch kernels inline, so callbacks
// only post work to a relay thread of our own, which does the rest.
//
// int32 tensors live in host memory on TF's GPU devices (TF convention), so
// the int32 kernels are registered with HostMemory and take the CPU route.
#if GOOGLE_CUDA

#ifndef EIGEN_USE_GPU
#define EIGEN_USE_GPU
#endif

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bps_api.h"
#include "core_abi.h"
#include "gpu/gpu_reduce.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace bps_tf {
namespace {

using tensorflow::AsyncOpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using DoneCallback = AsyncOpKernel::DoneCallback;

// Runs posted tasks, in order, on one thread that may call CUDA and TF.
// Never destroyed: a static destructor joining a thread at exit could hang.
class Relay {
 public:
  static Relay& Get() {
    static Relay* relay = new Relay();
    return *relay;
  }
  void Post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

 private:
  Relay() { std::thread([this] { Loop(); }).detach(); }
  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return !tasks_.empty(); });
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
};

// A stream callback: no CUDA calls allowed here, so it only posts.
void CUDART_CB PostFromStream(void* arg) {
  auto* task = static_cast<std::function<void()>*>(arg);
  Relay::Get().Post(std::move(*task));
  delete task;
}

cudaError_t ThenOnRelay(cudaStream_t stream, std::function<void()> task) {
  auto* boxed = new std::function<void()>(std::move(task));
  cudaError_t err = cudaLaunchHostFunc(stream, PostFromStream, boxed);
  if (err != cudaSuccess) delete boxed;
  return err;
}

// Everything one call needs until the end; the tensors keep their buffers
// alive while the engine and the copies use them.
struct Call {
  OpKernelContext* ctx = nullptr;  // invalid once `done` has run
  DoneCallback done;
  std::string name;
  int64_t priority = 0;
  std::string compression;  // the op's attr ("" for broadcast)
  std::string agreement;    // what workers must agree on beside the shape (a root)
  int dtype = -1;
  std::vector<int64_t> shape;
  size_t bytes = 0;
  std::vector<Tensor> inputs;
  Tensor output;
  Tensor host;  // pinned staging buffer (GPU path) or zeros (host path)
  cudaStream_t stream = nullptr;
  int device = 0;
};

// Ends a call that failed before any copy was left pending on its buffers.
void FinishNow(Call* c, const tensorflow::Status& status) {
  if (!status.ok()) c->ctx->SetStatus(status);
  DoneCallback done = std::move(c->done);
  delete c;
  done();
}

tensorflow::Status CudaStatus(const Call& c, const char* what, int err) {
  const char* why = err == cudaSuccess ? "" : cudaGetErrorString(static_cast<cudaError_t>(err));
  return tensorflow::errors::Internal("push_pull '", c.name, "': ", what, " failed: ", why,
                                      " (CUDA error ", err, ")");
}

void Enqueue(Call* c, const void* in, void* out, bps_done_fn on_done) {
  bps_enqueue_push_pull_ex(c->name.c_str(), c->dtype, c->shape.data(),
                           static_cast<int>(c->shape.size()), in, out, c->priority,
                           c->compression.c_str(), c->agreement.c_str(), on_done, c);
}

// ---- host route (int32 tensors in host memory) ----

void OnHostDone(void* arg, int status, const char* error) {
  FinishNow(static_cast<Call*>(arg), EngineStatus(status, error));
}

// ---- device route ----

// On the relay thread, after the engine: copy the sum back, then `done`.
void CopyBackAndFinish(Call* c, const tensorflow::Status& engine) {
  if (!engine.ok()) return FinishNow(c, engine);
  if (c->bytes == 0) return FinishNow(c, tensorflow::Status());
  cudaSetDevice(c->device);  // the relay thread serves every GPU
  cudaError_t err = cudaMemcpyAsync(const_cast<char*>(c->output.tensor_data().data()),
                                    c->host.tensor_data().data(), c->bytes,
                                    cudaMemcpyHostToDevice, c->stream);
  if (err != cudaSuccess) return FinishNow(c, CudaStatus(*c, "copy to the GPU", err));
  DoneCallback done = std::move(c->done);
  // The pinned buffer must outlive the copy: released by the stream itself.
  err = ThenOnRelay(c->stream, [c] { delete c; });
  if (err != cudaSuccess) {
    c->ctx->SetStatus(CudaStatus(*c, "cudaLaunchHostFunc", err));
    cudaStreamSynchronize(c->stream);
    delete c;
  }
  done();  // the copy is on the op's stream, ahead of every later kernel
}

void OnDeviceDone(void* arg, int status, const char* error) {
  Call* c = static_cast<Call*>(arg);
  // The message lives only during this call: the status carries a copy.
  tensorflow::Status engine = EngineStatus(status, error);
  Relay::Get().Post([c, engine] { CopyBackAndFinish(c, engine); });
}

class PushPullGpuOp : public AsyncOpKernel {
 public:
  explicit PushPullGpuOp(OpKernelConstruction* c, bool broadcast = false)
      : AsyncOpKernel(c), broadcast_(broadcast) {
    OP_REQUIRES_OK(c, c->GetAttr("tensor_name", &name_));
    OP_REQUIRES_OK(c, c->GetAttr("priority", &priority_));
    if (broadcast_) OP_REQUIRES_OK(c, c->GetAttr("root_rank", &root_rank_));
    if (!broadcast_) OP_REQUIRES_OK(c, c->GetAttr("compression", &compression_));
    OP_REQUIRES_OK(c, c->GetAttr("agreement", &agreement_));
    if (!broadcast_) {
      // Its local reduce of the replicas only sums; bps_tf places the other
      // reduce ops on the CPU.
      std::string op;
      OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &op));
      OP_REQUIRES(c, op == "sum",
                  tensorflow::errors::InvalidArgument(
                      "push_pull '", def().name(), "': reduce_op ", op,
                      " has no GPU kernel; place the op on the CPU"));
    }
    if (name_.empty()) name_ = def().name();
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& first = ctx->input(0);
    if (broadcast_ && bps_is_initialized()) {
      OP_REQUIRES_ASYNC(ctx, root_rank_ >= 0 && root_rank_ < bps_size(),
                        tensorflow::errors::InvalidArgument(
                            "broadcast '", name_, "': root_rank ", root_rank_,
                            " is outside [0, ", bps_size(), ")"),
                        done);
    }
    for (int i = 1; i < ctx->num_inputs(); ++i) {
      OP_REQUIRES_ASYNC(ctx, ctx->input(i).shape() == first.shape(),
                        tensorflow::errors::InvalidArgument(
                            "push_pull '", name_, "': input ", i, " has shape ",
                            ctx->input(i).shape().DebugString(), ", input 0 has ",
                            first.shape().DebugString()),
                        done);
    }
    Tensor* output = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, first.shape(), &output), done);
    Call* c = new Call;
    c->ctx = ctx;
    c->done = std::move(done);
    c->name = name_;
    c->agreement = JoinAgreement(broadcast_ ? BroadcastAgreement(root_rank_) : "", agreement_);
    c->priority = priority_;
    c->compression = compression_;
    c->dtype = CoreDType(first.dtype());
    for (int i = 0; i < first.dims(); ++i) c->shape.push_back(first.dim_size(i));
    c->bytes = first.tensor_data().size();
    for (int i = 0; i < ctx->num_inputs(); ++i) c->inputs.push_back(ctx->input(i));
    c->output = *output;
    // Broadcast is a sum in which every worker but the root adds zeros.
    const bool send_zeros = broadcast_ && bps_is_initialized() && bps_rank() != root_rank_;
    if (ctx->input_memory_type(0) == tensorflow::HOST_MEMORY) {
      HostRoute(c, send_zeros);
    } else {
      DeviceRoute(c, send_zeros);
    }
  }

 private:
  void HostRoute(Call* c, bool send_zeros) {
    char* out = const_cast<char*>(c->output.tensor_data().data());
    const void* in = c->inputs[0].tensor_data().data();
    if (c->inputs.size() > 1) {  // local sum of the replicas, on the CPU
      if (c->bytes) std::memcpy(out, in, c->bytes);
      for (size_t i = 1; i < c->inputs.size(); ++i) {
        bps_sum_into(c->dtype, out, c->inputs[i].tensor_data().data(),
                     c->inputs[i].NumElements());
      }
      in = out;
    }
    if (send_zeros) {
      tensorflow::AllocatorAttributes on_host;
      on_host.set_on_host(true);
      tensorflow::Status s =
          c->ctx->allocate_temp(c->output.dtype(), c->output.shape(), &c->host, on_host);
      if (!s.ok()) return FinishNow(c, s);
      if (c->bytes) std::memset(const_cast<char*>(c->host.tensor_data().data()), 0, c->bytes);
      in = c->host.tensor_data().data();
    }
    Enqueue(c, in, out, &OnHostDone);
  }

  void DeviceRoute(Call* c, bool send_zeros) {
    c->stream = c->ctx->eigen_device<Eigen::GpuDevice>().stream();
    int err = cudaGetDevice(&c->device);
    if (err != cudaSuccess) return FinishNow(c, CudaStatus(*c, "cudaGetDevice", err));
    tensorflow::AllocatorAttributes pinned;
    pinned.set_on_host(true);
    pinned.set_gpu_compatible(true);
    tensorflow::Status s =
        c->ctx->allocate_temp(c->output.dtype(), c->output.shape(), &c->host, pinned);
    if (!s.ok()) return FinishNow(c, s);
    void* host = const_cast<char*>(c->host.tensor_data().data());
    if (send_zeros || c->bytes == 0) {  // nothing to read from the GPU
      if (c->bytes) std::memset(host, 0, c->bytes);
      return Enqueue(c, host, host, &OnDeviceDone);
    }
    const void* src = c->inputs[0].tensor_data().data();
    if (c->inputs.size() > 1) {
      std::vector<const void*> srcs;
      for (const Tensor& t : c->inputs) srcs.push_back(t.tensor_data().data());
      void* sum = const_cast<char*>(c->output.tensor_data().data());
      err = bps_gpu_sum(c->dtype, sum, srcs.data(), static_cast<int>(srcs.size()),
                        static_cast<size_t>(c->output.NumElements()), c->stream);
      if (err != cudaSuccess) {
        return FinishNow(c, tensorflow::errors::Internal(
                                "push_pull '", c->name, "': local sum on the GPU failed: ",
                                bps_gpu_last_error_string()));
      }
      src = sum;
    }
    err = cudaMemcpyAsync(host, src, c->bytes, cudaMemcpyDeviceToHost, c->stream);
    if (err != cudaSuccess) return FinishNow(c, CudaStatus(*c, "copy to the host", err));
    err = ThenOnRelay(c->stream, [c, host] { Enqueue(c, host, host, &OnDeviceDone); });
    if (err != cudaSuccess) {
      cudaStreamSynchronize(c->stream);  // the copy must not land in freed memory
      return FinishNow(c, CudaStatus(*c, "cudaLaunchHostFunc", err));
    }
  }

  bool broadcast_;
  std::string name_;
  std::string compression_;
  std::string agreement_;
  tensorflow::int64 priority_ = 0;
  tensorflow::int64 root_rank_ = 0;
};

class BroadcastGpuOp : public PushPullGpuOp {
 public:
  explicit BroadcastGpuOp(OpKernelConstruction* c) : PushPullGpuOp(c, /*broadcast=*/true) {}
};

}  // namespace

#define BPS_REGISTER_GPU(T)                                                            \
  REGISTER_KERNEL_BUILDER(                                                             \
      Name("BytepsPushPull").Device(tensorflow::DEVICE_GPU).TypeConstraint<T>("T"),    \
      PushPullGpuOp);                                                                  \
  REGISTER_KERNEL_BUILDER(                                                             \
      Name("BytepsBroadcast").Device(tensorflow::DEVICE_GPU).TypeConstraint<T>("T"),   \
      BroadcastGpuOp);

BPS_REGISTER_GPU(Eigen::half)
BPS_REGISTER_GPU(Eigen::bfloat16)
BPS_REGISTER_GPU(float)
BPS_REGISTER_GPU(double)
BPS_REGISTER_GPU(tensorflow::int64)
#undef BPS_REGISTER_GPU

// int32 stays in host memory on GPU devices: these kernels take the host route.
REGISTER_KERNEL_BUILDER(Name("BytepsPushPull")
                            .Device(tensorflow::DEVICE_GPU)
                            .TypeConstraint<tensorflow::int32>("T")
                            .HostMemory("tensor")
                            .HostMemory("sum"),
                        PushPullGpuOp);
REGISTER_KERNEL_BUILDER(Name("BytepsBroadcast")
                            .Device(tensorflow::DEVICE_GPU)
                            .TypeConstraint<tensorflow::int32>("T")
                            .HostMemory("tensor")
                            .HostMemory("output"),
                        BroadcastGpuOp);

}  // namespace bps_tf

#endif  // GOOGLE_CUDA
