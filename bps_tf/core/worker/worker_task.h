// What the worker engine keeps per tensor name and per enqueued operation;
// shared by worker_engine.cc, worker_enqueue.cc, worker_queue.cc and
// worker_io.cc.
#ifndef BPS_TF_CORE_WORKER_WORKER_TASK_H_
#define BPS_TF_CORE_WORKER_WORKER_TASK_H_

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "math/compressor.h"
#include "worker/trace.h"
#include "worker/worker_engine.h"

namespace bps {

// One (name, shape, dtype) as the scheduler declared it.
// Where partition `part` of `parts` comes in a worker's sending order: in
// groups of `group` consecutive partitions (consecutive partitions go to
// different servers), each group started at its partition `stagger`.
inline uint32_t PartitionSendOrder(uint32_t part, uint32_t parts, uint32_t group,
                                   uint32_t stagger) {
  if (group <= 1) return part;
  uint32_t base = part - part % group;
  uint32_t width = std::min(group, parts - base);  // the last group may be short
  return base + (part - base + width - stagger % width) % width;
}

struct WorkerEngine::TensorInfo {
  uint64_t key = 0;
  std::vector<int> servers;  // server of each partition
  uint64_t part_bytes = 0;
  uint64_t next_round = 0;
  std::string error;  // the declaration failed; every use fails with it
  // Error-feedback residual and momentum of a compressed tensor (I/O thread).
  CompressorState compressor_state;
};

struct WorkerEngine::Task {
  std::string name;
  int dtype = 0;
  uint8_t reduce_op = 0;  // protocol.h ReduceOp
  bool refuse_joined = false;  // protocol.h kPushRefuseJoined
  uint64_t bytes = 0;
  const char* in = nullptr;
  char* out = nullptr;
  int64_t priority = 0;
  uint64_t seq = 0;
  bps_done_fn done = nullptr;
  void* ctx = nullptr;
  std::shared_ptr<TensorInfo> info;
  std::shared_ptr<const CompressorSpec> compressor;  // null: travels as it is
  // Pushes per round: the workers of its process set, or the hosts for a
  // local-reduce host sum; 0: every worker. protocol.h
  uint32_t contributors = 0;
  uint64_t members = 0;       // FrameHeader::members
  uint64_t round = 0;
  // Two counts per partition: its reply (or abandonment) and libzmq
  // releasing the zero-copy input buffer. done() runs when both are in.
  std::atomic<int> remaining{0};
  std::atomic<bool> failed{false};
  std::mutex error_mu;
  std::string error;       // the first failure wins
  int status = BPS_OK;     // with error
  Clock::time_point start = Clock::now();
  Clock::time_point scheduled{};
  bool stall_warned = false;   // touched by the I/O thread only
  std::vector<PartTimes> times;  // filled only when this round is traced

  uint64_t PartOffset(uint32_t part) const { return part * info->part_bytes; }
  uint64_t PartLength(uint32_t part) const {
    return std::min<uint64_t>(info->part_bytes, bytes - PartOffset(part));
  }
};

}  // namespace bps

#endif  // BPS_TF_CORE_WORKER_WORKER_TASK_H_
