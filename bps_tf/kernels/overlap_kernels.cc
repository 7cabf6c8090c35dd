// CPU kernels of the split push_pull (ops/overlap_ops.cc).
//
// BytepsPushPullStart enqueues the sum on the engine and records it in a
// per-process table under its tensor_name; BytepsPushPullWait takes the
// entry out of the table once the engine has finished it. A Wait that comes
// before the engine finishes parks its `done` callback in the entry, and the
// engine's callback completes it. Entries hold the input and output tensors,
// which keeps their buffers alive while the engine reads and writes them.
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bps_api.h"
#include "core_abi.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace bps_tf {

using tensorflow::AsyncOpKernel;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::TensorShape;

namespace {

struct Entry {
  std::string name;
  Tensor input;
  Tensor output;
  bool finished = false;  // the engine has called back
  bool held = false;      // finished, but kept back by BytepsPushPullDebugHold
  bool hold = false;      // to be held once finished
  Status status;
  // When a Wait first asked for it (the timeline's wait span begins there).
  std::chrono::steady_clock::time_point wait_began{};
  // The Wait parked on this entry, if any.
  OpKernelContext* waiter_ctx = nullptr;
  AsyncOpKernel::DoneCallback waiter_done;
};

using EntryPtr = std::shared_ptr<Entry>;

// Hands a finished entry to its Wait: its sum and valid=true, or the
// engine's error.
void Deliver(OpKernelContext* ctx, AsyncOpKernel::DoneCallback done, const EntryPtr& e) {
  if (!e->status.ok()) {
    ctx->SetStatus(e->status);
  } else if (e->output.dtype() != ctx->input(0).dtype() ||
             e->output.shape() != ctx->input(0).shape()) {
    ctx->SetStatus(tensorflow::errors::InvalidArgument(
        "push_pull_wait '", e->name, "': the pending sum is ",
        tensorflow::DataTypeString(e->output.dtype()), e->output.shape().DebugString(),
        " but the wait expects ", tensorflow::DataTypeString(ctx->input(0).dtype()),
        ctx->input(0).shape().DebugString()));
  } else {
    ctx->set_output(0, e->output);
    auto ns = [](std::chrono::steady_clock::time_point t) {
      return static_cast<int64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count());
    };
    bps_trace_wait(e->name.c_str(), ns(e->wait_began), ns(std::chrono::steady_clock::now()));
    Tensor* valid = nullptr;
    Status s = ctx->allocate_output(1, TensorShape({}), &valid);
    if (s.ok()) {
      valid->scalar<bool>()() = true;
    } else {
      ctx->SetStatus(s);
    }
  }
  done();
}

class Table {
 public:
  static Table* Get() {
    static Table* table = new Table();  // never destroyed: engine callbacks may outlive exit
    return table;
  }

  Status Start(const std::string& name, const Tensor& input, const Tensor& output,
               EntryPtr* out) {
    std::lock_guard<std::mutex> lock(mu_);
    if (entries_.count(name)) {
      return tensorflow::errors::FailedPrecondition(
          "push_pull_start '", name, "': a push_pull under this name is already pending "
          "(started and not yet taken by push_pull_wait; flush or wait for it first)");
    }
    auto e = std::make_shared<Entry>();
    e->name = name;
    e->input = input;
    e->output = output;
    if (!hold_name_.empty() && hold_name_ == name) {
      hold_name_.clear();
      e->hold = true;
      hold_entry_ = e;
    }
    entries_[name] = e;
    *out = e;
    return Status();
  }

  // The engine's callback for `e`.
  void Finished(const EntryPtr& e, Status status) {
    OpKernelContext* ctx = nullptr;
    AsyncOpKernel::DoneCallback done;
    int64_t timeout_ms = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      e->finished = true;
      e->status = status;
      if (e->hold) {
        e->hold = false;
        e->held = true;
        timeout_ms = hold_timeout_ms_;
      } else if (e->waiter_ctx != nullptr) {
        ctx = e->waiter_ctx;
        done = std::move(e->waiter_done);
        Erase(e);
      }
    }
    if (timeout_ms > 0) {
      std::thread([this, e, timeout_ms]() {
        std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
        Release(e, "timeout");
      }).detach();
    }
    if (ctx != nullptr) Deliver(ctx, std::move(done), e);
  }

  // Wait: completes `done` now, or parks it on the entry.
  void Wait(const std::string& name, OpKernelContext* ctx, AsyncOpKernel::DoneCallback done) {
    EntryPtr e;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = entries_.find(name);
      if (it != entries_.end()) {
        e = it->second;
        if (e->waiter_ctx != nullptr) {
          ctx->SetStatus(tensorflow::errors::FailedPrecondition(
              "push_pull_wait '", name, "': another wait is already waiting for it"));
          done();
          return;
        }
        e->wait_began = std::chrono::steady_clock::now();
        if (!e->finished || e->held) {
          e->waiter_ctx = ctx;
          e->waiter_done = std::move(done);
          return;
        }
        Erase(e);
      }
    }
    if (e == nullptr) {  // nothing pending: zeros, valid=false
      Tensor* sum = nullptr;
      Tensor* valid = nullptr;
      OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, ctx->input(0).shape(), &sum), done);
      OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(1, TensorShape({}), &valid), done);
      std::memset(const_cast<char*>(sum->tensor_data().data()), 0, sum->tensor_data().size());
      valid->scalar<bool>()() = false;
      done();
      return;
    }
    Deliver(ctx, std::move(done), e);
  }

  // A marker ran: ends the hold (see the op's doc).
  void Marker() {
    EntryPtr e;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (hold_entry_ == nullptr) return;
      e = hold_entry_;
      hold_entry_.reset();
      if (e->hold) {  // not finished yet: it will not be held
        e->hold = false;
        log_ += e->name + " in-flight-at marker\n";
        return;
      }
    }
    Release(e, "marker");
  }

  void Release(const EntryPtr& e, const std::string& by) {
    OpKernelContext* ctx = nullptr;
    AsyncOpKernel::DoneCallback done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!e->held) return;
      e->held = false;
      if (hold_entry_ == e) hold_entry_.reset();
      log_ += e->name + " released-by " + by + "\n";
      if (e->waiter_ctx != nullptr) {
        ctx = e->waiter_ctx;
        done = std::move(e->waiter_done);
        Erase(e);
      }
    }
    if (ctx != nullptr) Deliver(ctx, std::move(done), e);
  }

  std::vector<std::string> Keys() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> keys;
    for (const auto& kv : entries_) keys.push_back(kv.first);
    return keys;
  }

  void Hold(const std::string& name, int64_t timeout_ms) {
    std::lock_guard<std::mutex> lock(mu_);
    hold_name_ = name;
    hold_timeout_ms_ = timeout_ms;
  }

  std::string Log() {
    std::lock_guard<std::mutex> lock(mu_);
    return log_;
  }

 private:
  void Erase(const EntryPtr& e) {  // mu_ held
    auto it = entries_.find(e->name);
    if (it != entries_.end() && it->second == e) entries_.erase(it);
  }

  std::mutex mu_;
  std::map<std::string, EntryPtr> entries_;
  std::string hold_name_;
  int64_t hold_timeout_ms_ = 0;
  EntryPtr hold_entry_;  // started under hold_name_, not yet released
  std::string log_;
};

struct Callback {
  EntryPtr entry;
};

void OnEngineDone(void* arg, int status, const char* error) {
  std::unique_ptr<Callback> cb(static_cast<Callback*>(arg));
  Table::Get()->Finished(cb->entry, status == BPS_OK ? Status() : EngineStatus(status, error));
}

}  // namespace

class PushPullStartOp : public OpKernel {
 public:
  explicit PushPullStartOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("tensor_name", &name_));
    OP_REQUIRES_OK(c, c->GetAttr("priority", &priority_));
    if (name_.empty()) name_ = def().name();
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& input = ctx->input(0);
    Tensor output;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(input.dtype(), input.shape(), &output));
    EntryPtr e;
    OP_REQUIRES_OK(ctx, Table::Get()->Start(name_, input, output, &e));
    Tensor* token = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &token));
    token->scalar<tensorflow::int64>()() = ++count_;
    std::vector<int64_t> shape;
    for (int i = 0; i < input.dims(); ++i) shape.push_back(input.dim_size(i));
    // The engine may call back before this returns.
    bps_enqueue_push_pull(name_.c_str(), CoreDType(input.dtype()), shape.data(),
                          static_cast<int>(shape.size()), e->input.tensor_data().data(),
                          const_cast<char*>(e->output.tensor_data().data()), priority_,
                          &OnEngineDone, new Callback{e});
  }

 private:
  std::string name_;
  tensorflow::int64 priority_ = 0;
  tensorflow::int64 count_ = 0;
};

class PushPullWaitOp : public AsyncOpKernel {
 public:
  explicit PushPullWaitOp(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("tensor_name", &name_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    Table::Get()->Wait(name_, ctx, std::move(done));
  }

 private:
  std::string name_;
};

class PendingKeysOp : public OpKernel {
 public:
  explicit PendingKeysOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* ctx) override {
    std::vector<std::string> keys = Table::Get()->Keys();
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({static_cast<int64_t>(keys.size())}), &out));
    auto flat = out->flat<tensorflow::tstring>();
    for (size_t i = 0; i < keys.size(); ++i) flat(i) = keys[i];
  }
};

class DebugHoldOp : public OpKernel {
 public:
  explicit DebugHoldOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("command", &command_));
    OP_REQUIRES_OK(c, c->GetAttr("tensor_name", &name_));
    OP_REQUIRES_OK(c, c->GetAttr("timeout_ms", &timeout_ms_));
  }

  void Compute(OpKernelContext* ctx) override {
    if (command_ == "hold") Table::Get()->Hold(name_, timeout_ms_);
    if (command_ == "marker") Table::Get()->Marker();
    ctx->set_output(0, ctx->input(0));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &out));
    out->scalar<tensorflow::tstring>()() = Table::Get()->Log();
  }

 private:
  std::string command_;
  std::string name_;
  tensorflow::int64 timeout_ms_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("BytepsPushPullStart").Device(tensorflow::DEVICE_CPU),
                        PushPullStartOp);
REGISTER_KERNEL_BUILDER(Name("BytepsPushPullWait").Device(tensorflow::DEVICE_CPU),
                        PushPullWaitOp);
REGISTER_KERNEL_BUILDER(Name("BytepsPushPullPendingKeys").Device(tensorflow::DEVICE_CPU),
                        PendingKeysOp);
REGISTER_KERNEL_BUILDER(Name("BytepsPushPullDebugHold").Device(tensorflow::DEVICE_CPU),
                        DebugHoldOp);

}  // namespace bps_tf
