// The server's replies to each worker, in priority order, with a credit.
//
// Sums are ready in the order the last worker's push arrives, and a
// server's link back to one worker is often the slowest part of a step. If
// every reply went to libzmq at once, an urgent sum (the first layer's, the
// next forward pass needs it first) would wait behind every bulk sum ahead
// of it. So each worker gets a queue ordered by the pushes' priority, and
// at most `credit` bytes of replies are handed to libzmq (and, with
// TCP_NOTSENT_LOWAT, to the kernel) before libzmq has written them: the
// rest can still be overtaken.
#ifndef BPS_TF_CORE_SERVER_REPLY_SCHEDULER_H_
#define BPS_TF_CORE_SERVER_REPLY_SCHEDULER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <queue>
#include <vector>

#include "server/sum_engine.h"

namespace bps {

class ReplyScheduler {
 public:
  // credit_bytes: per worker (0: no limit, every reply leaves at once).
  // wake: called (from libzmq's I/O thread) when bytes were written, so
  // the owner calls Ready() again.
  ReplyScheduler(int num_workers, uint64_t credit_bytes, std::function<void()> wake);

  void Add(std::vector<ServerReply>&& replies);
  // The replies that may leave now, in order, grouped by worker. Their
  // payload bytes count against the worker's credit until the message
  // that carries them, wrapped by Track(), is freed by libzmq.
  std::vector<ServerReply> Ready(bool ignore_credit = false);
  // Wraps what goes to libzmq for `worker` (one reply's payload, or a
  // fused message of several): once freed, `reserved` bytes of credit
  // (those Ready() counted for the replies it carries) come back. Every
  // reply Ready() returned must pass through here, sent or not.
  Msg Track(int worker, Msg&& payload, uint64_t reserved);
  uint64_t queued() const { return queued_; }
  // Forgets every reply not yet returned by Ready() (a new membership
  // epoch: the old epoch's sums must reach no one).
  void DropQueued();

 private:
  struct Entry {
    int32_t priority;
    uint64_t seq;
    mutable ServerReply reply;  // moved out when popped
  };
  struct Order {
    bool operator()(const Entry& a, const Entry& b) const {
      if (a.priority != b.priority) return a.priority < b.priority;
      return a.seq > b.seq;  // older first
    }
  };
  struct Worker {
    std::priority_queue<Entry, std::vector<Entry>, Order> queue;
    uint64_t handed = 0;                 // bytes given to libzmq
    std::atomic<uint64_t> released{0};   // of which libzmq has freed
  };
  static void Release(void* data, void* hint);

  uint64_t credit_;
  std::function<void()> wake_;
  std::vector<std::unique_ptr<Worker>> workers_;
  uint64_t seq_ = 0;
  uint64_t queued_ = 0;
};

}  // namespace bps

#endif  // BPS_TF_CORE_SERVER_REPLY_SCHEDULER_H_
