// The worker side of the core: one per process.
//
// An enqueued push_pull is matched with the other workers by name (the
// scheduler checks that shapes and dtypes agree and assigns its partitions
// to servers), cut into partitions, and queued by priority. One I/O thread
// owns every socket: it sends partitions while the bytes in flight stay
// under the credit (zero-copy from the caller's buffer), copies each summed
// partition into the output, and calls `done` when the last one is back and
// libzmq has released the input.
//
// The class is implemented in four files: worker_engine.cc (joining and
// leaving the cluster, join(), failure), worker_enqueue.cc (taking an
// operation, tensor declarations), worker_queue.cc (the partition queue and
// the credit) and worker_io.cc (the I/O thread). Task and TensorInfo are in
// worker_task.h.
#ifndef BPS_TF_CORE_WORKER_WORKER_ENGINE_H_
#define BPS_TF_CORE_WORKER_WORKER_ENGINE_H_

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <queue>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "bps_api.h"
#include "common/common.h"
#include "math/compressor.h"
#include "scheduler/membership.h"
#include "transport/channel.h"
#include "transport/protocol.h"
#include "transport/transport.h"
#include "worker/burst.h"

namespace bps {

class WorkerEngine {
 public:
  static WorkerEngine& Get();

  void Init(const Config& cfg);  // throws Error
  // Leaves the cluster; `reason` (bps_worker_leave) travels with the goodbye.
  void Shutdown(const std::string& reason = "");
  bool initialized() const { return initialized_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  // Horovod's: this host's index among the hosts that have a worker of this
  // local rank, their number, and whether every host has as many workers.
  int cross_rank() const { return cross_rank_; }
  int cross_size() const { return cross_size_; }
  bool homogeneous() const { return homogeneous_; }
  // The workers sharing this process's host, as the scheduler grouped them
  // (set once joined; local_reduce.h uses them).
  struct HostGroup {
    int num_hosts = 1;
    int host_index = 0;
    std::vector<int> ranks;  // ascending, this rank among them
    std::string job_nonce;
  };
  HostGroup host_group() const { return host_group_; }

  // Holds partitions in the queue (for tests and diagnostics of the order).
  void PauseSends(bool paused);
  // Elastic: asks the scheduler to let this worker leave at the next commit
  // (SIGTERM; docs/elastic.md). False when it is not a member now.
  bool RequestLeave();

  void Enqueue(const std::string& name, int dtype, const std::vector<int64_t>& shape,
               const void* in, void* out, int64_t priority, bps_done_fn done, void* ctx,
               const std::string& compression = "", const std::string& agreement = "",
               int reduce_op = 0, uint32_t contributors = 0);

  // join(): waits for this worker's operations in flight, tells every
  // server (after its pushes) and the scheduler that it joined, and blocks
  // until every worker has; returns the rank that joined last. Throws Error.
  int Join();
  // Operations under `name` fail instead of completing while a worker has
  // joined (allgathers; broadcasts are marked by their root agreement).
  void RefuseWhenJoined(const std::string& name);

  struct TensorInfo;
  struct Task;

 private:
  struct PartRef {
    Task* task;
    uint32_t part;
  };
  struct Order {
    const WorkerEngine* engine;  // its rank and server count order the partitions
    bool operator()(const PartRef& a, const PartRef& b) const;
  };
  enum class State { kIdle, kJoining, kReady, kFailed, kStopped };

  // Init's steps: forget the last cluster and take `cfg` (needs mu_), read
  // the settings of a cluster member, and start joining it (the I/O thread).
  void ResetLocked(const Config& cfg);
  void ReadSettings(const Config& cfg);
  void JoinCluster(const Config& cfg);
  // Enqueue's steps. Why the process set an agreement names ("set=0,2"),
  // into *members, cannot take this call ("" if it can).
  std::string CheckMembers(const std::string& name, const std::string& agreement, int reduce_op,
                           uint32_t contributors, std::vector<int>* members) const;
  // Hands a checked task, described by `sig`, to the queue or fails it.
  void Submit(Task* task, const std::string& sig, const std::vector<int>& members,
              uint32_t contributors);
  // Schedules the task if its name is declared, else queues a declaration
  // (once per name and signature); true when the task is already finished.
  bool ScheduleOrDeclareLocked(Task* task, const std::string& sig, const std::vector<int>& members,
                               uint32_t contributors, std::string* error);

  void IoLoop();
  void HandleControl(const Message& m);
  void HandleData(const Message& m);
  void OnWelcome(const Config& w);
  void OnDeclared(uint64_t request_id, const Config& kv);
  void SendReadyParts();
  // Takes from the queue, in order, what the credit lets leave now, and the
  // parts of failed tasks; false while small partitions wait for company.
  bool TakeSendable(std::vector<PartRef>* to_send, std::vector<Task*>* dropped);
  // Seconds until the current burst of enqueues stops limiting the credit
  // (0: it does not). Needs mu_.
  double BurstLeftLocked() const;
  void SendJoin();
  // Send one partition alone / several small ones for one server in one
  // message; false when the link failed.
  bool SendPart(const PartRef& p);
  bool SendFused(int server, const std::vector<PartRef>& parts);
  bool Fuses(const Task* t, uint64_t len) const;
  // delivered: the channel already decrypted the reply into its place in
  // the output (ReplyDestination), so `data` is not to be read.
  void HandleReply(const FrameHeader& h, const char* data, size_t size, bool delivered = false);
  // The partition in flight a reply answers (its key, this round), or null.
  const PartRef* Awaiting(const FrameHeader& h) const;
  // Where an uncompressed pull reply of `bytes` for a partition in flight
  // belongs in its task's output, or null (the channel's payload sink).
  char* ReplyDestination(const FrameHeader& h, size_t bytes);
  void FlushControl();
  // Ends every pending operation with `message` and `status` (a bps_status).
  void Fatal(const std::string& message, int status, bool peer_failure = true);
  void CheckTimers();
  // Elastic: re-registers with a scheduler that was lost (docs/elastic.md);
  // true when it did or gave up (the job then failed).
  bool RelinkIfLost(State state);
  // Elastic: a server (its place in servers_) this worker cannot reach any
  // more ends the membership epoch; false when the job is not elastic.
  bool ServerGone(int server, const std::string& why);
  static std::string PeerLeftText(const Config& left);
  void CheckStalledPushes();
  void Leave(const std::string& reason);
  void CloseChannel();

  // Scheduling helpers; *_Locked run with mu_ held and never touch sockets.
  bool ScheduleLocked(Task* task, const std::shared_ptr<TensorInfo>& info);
  void FailTask(Task* task, int status, const std::string& why);
  void Release(Task* task, int count);
  void Complete(Task* task);
  static void FreePart(void* data, void* hint);  // libzmq's release callback
  static void FreeFused(void* data, void* hint);
  // The compressed bytes of a partition (error feedback, momentum applied).
  Msg CompressPart(Task* task, uint32_t part, uint64_t key);
  bool Compresses(const CompressorSpec& spec, int dtype, uint64_t bytes) const;

  Config cfg_;
  std::atomic<bool> initialized_{false};
  bool local_mode_ = false;
  uint16_t epoch_ = 0;  // elastic: the membership epoch, in every message to a server
  // Elastic: the membership the last Init left (a rejoining HELLO tells it, so
  // that a scheduler restarted meanwhile awaits every member of it).
  struct LastMembership {
    int epoch = 0, size = 0, servers = 0;
  } last_membership_;
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1, cross_rank_ = 0, cross_size_ = 1;
  bool homogeneous_ = true;
  HostGroup host_group_;
  int num_servers_ = 0;
  bool enable_ipc_ = true;  // reach servers on this machine over Unix sockets
  uint64_t partition_bytes_ = kDefaultPartitionBytes;
  uint64_t min_compress_bytes_ = 4096;
  uint64_t credit_bytes_ = 0;
  uint64_t fusion_bytes_ = 0;  // largest fused message; 0: no fusion
  double cycle_s_ = 0;         // how long small partitions may wait for company
  double timeout_s_ = 30, heartbeat_s_ = 1, op_timeout_s_ = 0, fatal_exit_s_ = 15;
  bool elastic_ = false;
  double recovery_s_ = 120;  // BYTEPS_SCHEDULER_RECOVERY_TIMEOUT
  // A sent push whose round the other workers do not complete (a later call
  // of a name that some worker skipped): warned about, then failed.
  double stall_check_s_ = 60, stall_shutdown_s_ = 600;
  Clock::time_point stall_scanned_{};  // I/O thread only: the scan runs at most every 0.25 s
  std::string scheduler_endpoint_;

  // Never destroyed (the engine is not): libzmq's release callbacks notify it
  // even while the channel closes.
  Wakeup wake_;
  std::unique_ptr<Channel> channel_;
  std::unique_ptr<Membership> membership_;
  std::vector<Peer> servers_;  // empty until WELCOME and after a failure
  std::vector<int> server_ids_;  // each one's server id (elastic: ids are sparse)
  std::thread io_thread_;
  std::atomic<bool> stop_requested_{false};
  std::string leave_reason_;  // set by Shutdown before the I/O thread stops

  // Guarded by mu_.
  std::mutex mu_;
  std::condition_variable state_cv_;
  State state_ = State::kIdle;
  std::string fatal_;
  int fatal_status_ = BPS_OK;
  std::string peer_left_;  // set when another worker shut down: who, and why
  Clock::time_point peer_left_at_;
  // The I/O thread's last data message from a server: pending push_pulls
  // fail once a peer left and no sum came for the grace, so a slow server
  // still answering (a round summed before the peer left, its replies queued
  // behind hundreds of workers') is not taken for a round that never completes.
  Clock::time_point last_data_;
  static constexpr double kPeerLeftGraceS = 3.0;
  std::set<std::string> names_in_flight_;
  std::map<std::string, std::shared_ptr<TensorInfo>> tensors_;  // name|sig
  std::map<std::string, std::vector<Task*>> declaring_;           // name|sig
  std::map<uint64_t, std::string> request_sig_;
  std::vector<std::pair<uint64_t, std::string>> control_outbox_;  // declarations to send
  bool leave_requested_ = false;  // elastic: a kLeave to send (RequestLeave)
  std::priority_queue<PartRef, std::vector<PartRef>, Order> ready_{Order{this}};
  uint64_t ready_bytes_ = 0;  // in ready_
  Clock::time_point hold_since_{};  // small partitions wait for company since
  EnqueueBurst burst_;  // while it lasts, one partition in flight (burst.h)
  uint64_t next_seq_ = 0;
  uint64_t next_request_ = 1;

  bool sends_paused_ = false;

  // join(), guarded by mu_.
  std::set<std::string> refuse_joined_names_;
  bool joining_ = false;
  bool join_send_ = false;   // the I/O thread has the join messages to send
  int join_acks_ = 0;        // servers that saw every worker join
  int join_last_ = -1;       // the scheduler's answer: who joined last
  uint64_t joins_seen_ = 0;  // workers counted as joined in replies since our last join
                             // (I/O thread only)

  // Credit: bytes handed to libzmq (I/O thread) minus bytes it released.
  uint64_t credit_handed_ = 0;
  std::atomic<uint64_t> credit_released_{0};

  // I/O thread only.
  std::unordered_map<uint64_t, PartRef> in_flight_;  // partition key -> part
};

}  // namespace bps

#endif  // BPS_TF_CORE_WORKER_WORKER_ENGINE_H_
