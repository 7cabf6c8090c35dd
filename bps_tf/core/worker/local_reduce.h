// Local reduce: the workers of one host sum a tensor through shared memory,
// and only the host's root (its lowest rank) pushes and pulls that sum, so a
// host's link carries each gradient once whatever its number of workers.
//
// It sits in front of WorkerEngine::Enqueue. The root listens on an abstract
// Unix socket named after the job and the host (abstract names vanish with
// their sockets and live in the network namespace, so nothing is left behind
// on a crash and namespaced "hosts" stay apart). Each other worker connects
// once and keeps a pool of anonymous memfds (an operation takes a free one
// that fits), handing each new descriptor to the root over the socket; the
// memory has no name, so it is freed when the last process holding it exits.
// Per operation: a member copies its input into its memfd and sends CONTRIB;
// the root sums every memfd into its own output, enqueues that to the engine
// with the op's priority and `contributors` = number of hosts, writes the
// global sum back into each memfd and sends RESULT; the member copies it out.
//
// A peer whose socket closes (it exited or crashed) fails every pending and
// later operation of this process with an error naming it. Compressed and
// asynchronous operations bypass the host sum (every worker pushes them).
#ifndef BPS_TF_CORE_WORKER_LOCAL_REDUCE_H_
#define BPS_TF_CORE_WORKER_LOCAL_REDUCE_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "bps_api.h"
#include "common/common.h"

namespace bps {

class LocalReduce {
 public:
  static LocalReduce& Get();

  // After the engine joined: connects this host's workers when the job runs
  // several on one host and `local_reduce` is on. Throws Error.
  void Start(const Config& cfg);
  void Stop();
  bool active() const;

  // WorkerEngine::Enqueue's contract; what is not summed on the host goes
  // straight to the engine.
  void Enqueue(const std::string& name, int dtype, const std::vector<int64_t>& shape,
               const void* in, void* out, int64_t priority, bps_done_fn done, void* ctx,
               const std::string& compression, const std::string& agreement);

  struct Impl;

 private:
  void StartLoop(Impl* impl);
  std::atomic<Impl*> impl_{nullptr};  // null while inactive
};

}  // namespace bps

#endif  // BPS_TF_CORE_WORKER_LOCAL_REDUCE_H_
