// The state of one process's local reduce (local_reduce.h), shared by
// local_reduce.cc (starting, stopping, taking operations, the loop thread
// and its connections) and local_reduce_gather.cc (what the loop does with
// each operation: a member's contribution, the root's gather, sum and
// push, the results, failures and time-outs).
#ifndef BPS_TF_CORE_WORKER_LOCAL_REDUCE_IMPL_H_
#define BPS_TF_CORE_WORKER_LOCAL_REDUCE_IMPL_H_

#include <unistd.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "worker/local_reduce.h"
#include "worker/local_reduce_link.h"

namespace bps {

struct LocalReduce::Impl {
  struct Op {
    std::string name, sig, agreement;
    int dtype = 0;
    std::vector<int64_t> shape;
    uint64_t bytes = 0;
    const char* in = nullptr;
    char* out = nullptr;
    int64_t priority = 0;
    bps_done_fn done = nullptr;
    void* ctx = nullptr;
    uint64_t round = 0;
    size_t slot = 0;  // member: the memfd it travels in
    Clock::time_point start = Clock::now();
  };
  // A member's memfds, reused by whichever operation fits, so memory follows
  // the bytes in flight, not the number of names (unnamed eager calls make
  // a new name each time).
  struct Slot {
    std::shared_ptr<SharedRegion> region;
    bool busy = false;
  };
  struct Contribution {
    std::string sig;
    uint64_t round;
    std::shared_ptr<SharedRegion> region;
  };
  struct Gather {  // root: one name's operation this round
    std::unique_ptr<Op> own;
    std::map<int, Contribution> from;
    Clock::time_point since = Clock::now();
  };
  struct Conn {
    std::unique_ptr<LocalLink> link;
    int rank = -1;  // -1 until its HELLO
  };
  struct Finished {
    Gather* gather;
    int status;
    std::string error;
  };

  int rank = 0, root = 0, num_hosts = 1;
  std::vector<int> peers;  // the host's other ranks
  double op_timeout_s = 0;
  int wake_fd = -1, listen_fd = -1;
  std::map<int, Conn> conns;  // by fd
  std::thread thread;
  std::atomic<bool> stop{false};

  std::mutex mu;  // guards the four below
  std::vector<Op*> incoming;
  std::vector<Finished> finished;
  std::string failed;
  bool stopped = false;  // the loop has ended: the engine's callbacks finish ops themselves

  // Loop thread only.
  std::map<std::string, uint64_t> rounds;                      // name -> next round
  std::vector<Slot> slots;                                     // member
  std::map<std::string, std::unique_ptr<Op>> waiting;          // member: name -> op
  std::map<std::string, Gather> gathers;                       // root: name -> this round
  std::map<std::pair<int, uint64_t>, std::shared_ptr<SharedRegion>> member_regions;  // root
  std::map<Gather*, std::unique_ptr<Gather>> running;          // root: in the engine

  bool is_root() const { return rank == root; }
  void Wake() {
    uint64_t one = 1;
    ssize_t n = write(wake_fd, &one, sizeof(one));
    (void)n;
  }

  static LocalPacket Packet(LocalKind kind, int rank, const Op* op, uint64_t round) {
    LocalPacket p;
    p.kind = kind;
    p.rank = rank;
    p.round = round;
    if (op) {
      p.name = op->name;
      p.sig = op->sig;
      p.dtype = op->dtype;
      p.bytes = op->bytes;
    }
    return p;
  }

  std::string Who(int r) const {
    return std::string(r == root ? "the local-reduce root, worker " : "worker ") +
           std::to_string(r) + " on this host";
  }

  // Every pending and later operation fails with `why`.
  void Fail(const std::string& why);
  // `counted`: the engine already counted it (the root's pushed sum).
  void Finish(Op* op, int status, const std::string& error, bool counted = false);
  Conn* ConnOf(int r);
  // Root: tells each contributor of `name` how its operation ended; on
  // success the global sum (in `sum`) goes into each one's memory first.
  void SendResults(Gather& g, const std::string& name, const char* sum, uint64_t bytes,
                   int status, const std::string& error);
  // An operation of this process: a member hands it to the root through its
  // memfd; the root gathers it with its members' and runs it (TryRun).
  void OnOwn(std::unique_ptr<Op> op);
  // Root: once the host's workers all contributed, sums them and enqueues
  // the host's sum to the engine.
  void TryRun(const std::string& name);
  // The engine's callback (its I/O thread, or inside Enqueue): the copies
  // back to the members happen on the loop thread.
  static void EngineDone(void* ctx, int status, const char* message);
  void OnFinished(const Finished& f);
  // One packet from a connection; false when the peer is gone or broke
  // the protocol.
  bool Receive(Conn& c);
  void CheckTimeouts();
  // The loop thread: connections, operations in, results out.
  void Loop();
  void Accept();
  void Drop(int fd);
};

}  // namespace bps

#endif  // BPS_TF_CORE_WORKER_LOCAL_REDUCE_IMPL_H_
