// The worker engine's life cycle: joining the cluster, leaving it, join(),
// and failing every operation when the job breaks. Operations come in
// through worker_enqueue.cc; the queue is in worker_queue.cc, the I/O in
// worker_io.cc.
#include "worker/worker_engine.h"

#include <unistd.h>

#include <algorithm>

#include "common/limits.h"
#include "common/stats.h"
#include "transport/cipher_pool.h"
#include "transport/local_links.h"
#include "worker/trace.h"
#include "worker/worker_task.h"

namespace bps {

WorkerEngine& WorkerEngine::Get() {
  static WorkerEngine* engine = new WorkerEngine();  // never destroyed on purpose
  return *engine;
}

void WorkerEngine::Init(const Config& cfg) {
  if (initialized_) return;
  std::unique_lock<std::mutex> lock(mu_);
  if (state_ != State::kIdle && state_ != State::kStopped) {
    throw Error("bps_tf is already initialising or has failed: " + fatal_);
  }
  // Elastic: the membership this engine leaves, told in a rejoining HELLO.
  last_membership_ = {epoch_, size_, num_servers_};
  ResetLocked(cfg);
  std::string role = cfg.Get("role", "local");
  local_mode_ = role == "local" || role == "evaluator" || (size_ == 1 && num_servers_ == 0);
  if (local_mode_) {
    rank_ = 0;
    size_ = 1;
    state_ = State::kReady;
    initialized_ = true;
    return;
  }
  if (role != "worker") {
    throw Error("this process has role '" + role +
                "'; only workers call bps_tf.init() (servers run `python -m bps_tf.server`)");
  }
  if (num_servers_ < 1) throw Error("a cluster of several workers needs at least one server");

  if (cfg.GetInt("malloc_keep_buffers", 1)) Stats::Get().heap_keeps_buffers = KeepFreedBuffersInHeap();
  ReadSettings(cfg);
  double rendezvous_s = cfg.GetDouble("rendezvous_timeout_s", 120);
  JoinCluster(cfg);

  bool met = state_cv_.wait_for(lock, std::chrono::duration<double>(rendezvous_s),
                                [this] { return state_ != State::kJoining; });
  if (met && state_ == State::kReady) {
    initialized_ = true;
    BPS_LOG(kInfo, "joined: rank " << rank_ << " of " << size_ << ", " << num_servers_ << " servers");
    return;
  }
  std::string why = fatal_;
  lock.unlock();
  stop_requested_ = true;
  wake_.Notify();
  if (io_thread_.joinable()) io_thread_.join();
  if (why.empty()) why = membership_->RendezvousFailure(rendezvous_s);
  CloseChannel();
  lock.lock();
  state_ = State::kStopped;
  throw Error(why);
}

void WorkerEngine::ResetLocked(const Config& cfg) {
  cfg_ = cfg;
  SetLogLevel(cfg.Get("log_level", "WARNING"));
  rank_ = static_cast<int>(cfg.GetInt("rank", 0));
  epoch_ = 0;
  Stats::Get().elastic_epoch = 0;
  Stats::Get().elastic_announced = 0;
  Stats::Get().elastic_waiting = 0;
  Stats::Get().ClearElastic();
  size_ = static_cast<int>(cfg.GetInt("num_workers", 1));
  num_servers_ = static_cast<int>(cfg.GetInt("num_servers", 0));
  local_rank_ = 0;
  local_size_ = 1;
  cross_rank_ = rank_;  // until the welcome says otherwise: one worker per host
  cross_size_ = size_;
  homogeneous_ = true;
  host_group_ = HostGroup();
  host_group_.ranks = {rank_};
  // An elastic newcomer has no rank until the scheduler admits it.
  SetLogIdentity(rank_ < 0 ? "new worker (waiting to join)" : "worker " + std::to_string(rank_));
  // A new cluster after shutdown(): nothing learned from the old one holds.
  tensors_.clear();
  declaring_.clear();
  request_sig_.clear();
  names_in_flight_.clear();
  peer_left_.clear();
  sends_paused_ = false;
  Trace::Get().Configure(cfg.GetInt("trace_on", 0) != 0, cfg.Get("trace_dir", "."), rank_,
                         cfg.GetInt("trace_start_step", 0), cfg.GetInt("trace_end_step", 20));
  fatal_.clear();
  fatal_status_ = BPS_OK;
  Stats::Get().send_log_on = cfg.GetInt("send_log", 0) != 0;
}

void WorkerEngine::ReadSettings(const Config& cfg) {
  partition_bytes_ = static_cast<uint64_t>(cfg.GetInt("partition_bytes", kDefaultPartitionBytes));
  if (partition_bytes_ < 8) throw Error("BYTEPS_PARTITION_BYTES must be at least 8");
  min_compress_bytes_ =
      static_cast<uint64_t>(std::max<int64_t>(0, cfg.GetInt("min_compress_bytes", 4096)));
  int64_t credit = cfg.GetInt("credit_bytes", 0);
  credit_bytes_ = credit > 0 ? static_cast<uint64_t>(credit) : 8 * partition_bytes_;
  int64_t fusion = cfg.GetInt("fusion_threshold", 0);
  if (fusion < 0) throw Error("BYTEPS_FUSION_THRESHOLD must not be negative");
  // A server accepts messages up to its partition size (at least 1 MiB,
  // server_node.cc): a larger fused one would be dropped there.
  fusion_bytes_ = std::min<uint64_t>(static_cast<uint64_t>(fusion),
                                     std::max<uint64_t>(partition_bytes_, 1 << 20));
  enable_ipc_ = cfg.GetInt("enable_ipc", 1) != 0;
  cycle_s_ = cfg.GetDouble("fusion_cycle_ms", 0) / 1000.0;
  if (cycle_s_ < 0) throw Error("BYTEPS_FUSION_CYCLE_TIME_MS must not be negative");
  double burst_ms = cfg.GetDouble("burst_ms", 10), burst_gap_ms = cfg.GetDouble("burst_gap_ms", 1);
  if (!(burst_ms >= 0) || !(burst_gap_ms >= 0)) {
    throw Error("BYTEPS_SCHEDULING_BURST_MS and BYTEPS_SCHEDULING_BURST_GAP_MS must not be negative");
  }
  burst_ = EnqueueBurst(burst_ms / 1000.0, burst_gap_ms / 1000.0);
  timeout_s_ = cfg.GetDouble("timeout_s", 30);
  heartbeat_s_ = cfg.GetDouble("heartbeat_s", 1);
  op_timeout_s_ = cfg.GetDouble("op_timeout_s", 0);
  stall_check_s_ = cfg.GetDouble("stall_check_s", 60);
  stall_shutdown_s_ = cfg.GetDouble("stall_shutdown_s", 600);
  fatal_exit_s_ = cfg.GetDouble("fatal_exit_s", 15);
  elastic_ = cfg.GetInt("elastic", 0) != 0;
  recovery_s_ = cfg.GetDouble("scheduler_recovery_s", 120);
}

void WorkerEngine::JoinCluster(const Config& cfg) {
  scheduler_endpoint_ =
      Endpoint(cfg.Get("scheduler_host", "127.0.0.1"), cfg.GetInt("scheduler_port", 0));
  SetCipherThreads(static_cast<int>(cfg.GetInt("cipher_threads", 0)));
  // A link to every server and one to the scheduler.
  EnsureOpenFiles(kBaseOpenFiles + num_servers_ + 1,
                  "worker " + std::to_string(rank_) + " of " + std::to_string(num_servers_) +
                      " servers");
  channel_ = MakeZmqChannel(static_cast<int>(cfg.GetInt("zmq_io_threads", 1)), &wake_,
                            LinkSecurity::FromConfig(cfg),
                            static_cast<int>(cfg.GetInt("tcp_notsent_lowat", 0)));
  membership_.reset(new Membership(channel_.get(), Role::kWorker, rank_, heartbeat_s_));
  channel_->SetPayloadSink(
      [this](const FrameHeader& h, size_t bytes) { return ReplyDestination(h, bytes); });
  Config extra;
  extra.Set("local_rank", cfg.Get("local_rank", "-1"));
  extra.Set("local_size", cfg.Get("local_size", "-1"));
  // Elastic: a member coming back after a membership change (its rank is the
  // old one); any other HELLO once the job runs is a newcomer's.
  extra.Set("rejoin", cfg.Get("elastic_rejoin", "0"));
  // ... and the epoch it comes from: a scheduler restarted meanwhile takes
  // this HELLO as its report (scheduler_recover.cc).
  if (cfg.Get("elastic_rejoin", "0") == "1") {
    extra.Set("epoch", std::to_string(last_membership_.epoch));
    extra.Set("size", std::to_string(last_membership_.size));
    extra.Set("servers", std::to_string(last_membership_.servers));
  }
  // Elastic: the launcher's name for this process (it reports the process's
  // end under it), and the rank it planned for a newcomer.
  extra.Set("launch_id", cfg.Get("launch_id"));
  extra.Set("start_rank", cfg.Get("start_rank", "-1"));
  // Which workers can sum through shared memory (local_reduce.h): one
  // machine, one advertised address and one network namespace (the local
  // reduce socket lives in it; namespaced "hosts" of one machine stay apart).
  extra.Set("host_key",
            cfg.Get("hostname") + " " + cfg.Get("advertise_host") + " " + NetnsLink());
  membership_->Join(scheduler_endpoint_, cfg, extra);
  state_ = State::kJoining;
  stop_requested_ = false;
  io_thread_ = std::thread([this] {
    NameThisThread("bps-io");
    IoLoop();
  });
}

void WorkerEngine::Shutdown(const std::string& reason) {
  if (!initialized_) return;
  initialized_ = false;
  if (local_mode_) {
    std::lock_guard<std::mutex> lock(mu_);
    state_ = State::kStopped;
    return;
  }
  leave_reason_ = reason;  // read by the I/O thread once it sees stop_requested_
  stop_requested_ = true;
  wake_.Notify();
  if (io_thread_.joinable()) io_thread_.join();
  CloseChannel();
  std::lock_guard<std::mutex> lock(mu_);
  state_ = State::kStopped;
}

void WorkerEngine::CloseChannel() {
  membership_.reset();
  servers_.clear();
  channel_.reset();  // waits for the goodbye's linger, if any
}

void WorkerEngine::Fatal(const std::string& message, int status, bool peer_failure) {
  std::vector<Task*> finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!fatal_.empty()) return;
    fatal_ = message;
    fatal_status_ = status;
    if (peer_failure) BPS_LOG(kError, message);
    for (auto& d : declaring_) {
      for (Task* t : d.second) {
        FailTask(t, status, message);
        finished.push_back(t);
      }
    }
    declaring_.clear();
    bool was_ready = state_ == State::kReady;
    state_ = State::kFailed;
    state_cv_.notify_all();
    if (peer_failure && was_ready && fatal_exit_s_ > 0) {
      // A peer is gone: give the program a moment to see the error, then end
      // the process so an idle worker cannot wait forever.
      double grace = fatal_exit_s_;
      std::thread([grace, message] {
        std::this_thread::sleep_for(std::chrono::duration<double>(grace));
        LogLine(LogLevel::kError, "exiting: " + message);
        _exit(1);
      }).detach();
    }
  }
  for (Task* t : finished) Complete(t);
  std::vector<Task*> abandoned;
  for (auto& kv : in_flight_) {
    FailTask(kv.second.task, status, message);
    abandoned.push_back(kv.second.task);
  }
  in_flight_.clear();
  std::vector<Task*> unsent;
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (!ready_.empty()) {
      FailTask(ready_.top().task, status, message);
      unsent.push_back(ready_.top().task);
      ready_.pop();
    }
    ready_bytes_ = 0;
  }
  for (Task* t : abandoned) Release(t, 1);  // the reply will not come
  for (Task* t : unsent) Release(t, 2);     // neither sent nor replied
  // Closing the server links drops their queued frames, so libzmq releases
  // every input buffer and the remaining counts reach zero.
  for (const Peer& server : servers_) channel_->Close(server);
  servers_.clear();
}

void WorkerEngine::RefuseWhenJoined(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  refuse_joined_names_.insert(name);
}

int WorkerEngine::Join() {
  std::unique_lock<std::mutex> lock(mu_);
  if (!initialized_) throw Error("bps_tf is not initialized: call bps_tf.init() first");
  if (local_mode_) return 0;
  if (joining_) throw Error("join() is already running in another thread");
  // The join must reach each server after this worker's pushes.
  state_cv_.wait(lock, [this] { return names_in_flight_.empty() || !fatal_.empty(); });
  if (!fatal_.empty()) throw Error("join() failed: " + fatal_);
  joining_ = true;
  join_send_ = true;
  join_acks_ = 0;
  join_last_ = -1;
  lock.unlock();
  wake_.Notify();
  lock.lock();
  state_cv_.wait(lock, [this] {
    return (join_acks_ == num_servers_ && join_last_ >= 0) || !fatal_.empty();
  });
  joining_ = false;
  if (!fatal_.empty()) throw Error("join() failed: " + fatal_);
  return join_last_;
}

void WorkerEngine::SendJoin() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!join_send_) return;
    join_send_ = false;
  }
  for (const Peer& server : servers_) {
    FrameHeader h = MakeHeader(MsgType::kJoin, Role::kWorker, rank_);
    h.epoch = epoch_;
    channel_->Send(server, h, Msg());
  }
  // The joins this worker's results already counted came before its own:
  // the scheduler must not name any of them as the last to join.
  membership_->Send(MsgType::kJoinNotice, "seen=" + std::to_string(joins_seen_));
  Stats::Get().join_seen_sent = joins_seen_;
  joins_seen_ = 0;
}

}  // namespace bps
