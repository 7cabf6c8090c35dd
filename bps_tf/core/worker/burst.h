// A worker's bursts of enqueues: a train step hands the engine all of its
// push_pulls within a few milliseconds, in whatever order TensorFlow's
// executor runs the ops, and that order differs from worker to worker.
// While a burst is still arriving the worker keeps only one partition in
// flight, so the priority queue (the same on every worker) orders the rest;
// a sum completes only once every worker has pushed its partition, so
// workers that commit different tensors first wait for one another.
#ifndef BPS_TF_CORE_WORKER_BURST_H_
#define BPS_TF_CORE_WORKER_BURST_H_

#include <algorithm>

namespace bps {

class EnqueueBurst {
 public:
  EnqueueBurst() = default;  // never limits
  // limit_s: how long, from its first enqueue, a burst may limit the credit
  // (0: never); gap_s: an enqueue within this long of the previous one
  // continues the burst.
  EnqueueBurst(double limit_s, double gap_s) : limit_s_(limit_s), gap_s_(gap_s) {}
  bool Enabled() const { return limit_s_ > 0; }

  // Times are seconds on one steady clock.
  void Enqueued(double now) {
    if (!seen_ || now - last_ >= gap_s_) start_ = now;  // a pause ended the previous burst
    last_ = now;
    seen_ = true;
  }

  // Seconds from `now` until the current burst stops limiting the credit:
  // at the gap after its latest enqueue or at its limit, whichever is first.
  // 0: no burst limits it now.
  double LimitLeft(double now) const {
    if (!Enabled() || !seen_) return 0;
    return std::max(0.0, std::min(last_ + gap_s_, start_ + limit_s_) - now);
  }

 private:
  double limit_s_ = 0, gap_s_ = 0;
  bool seen_ = false;
  double start_ = 0, last_ = 0;
};

}  // namespace bps

#endif  // BPS_TF_CORE_WORKER_BURST_H_
