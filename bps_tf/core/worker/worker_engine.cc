// The worker engine's life cycle: joining the cluster, taking operations,
// matching them with the scheduler's declarations, and failing them all when
// the job breaks. The queue is in worker_queue.cc, the I/O in worker_io.cc.
#include "worker/worker_engine.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "common/stats.h"
#include "transport/local_links.h"
#include "worker/trace.h"
#include "worker/worker_task.h"

namespace bps {

namespace {
// The ranks after "set=" in an agreement ("root=1 set=0,2"): the process set
// of the operation, which the scheduler and the servers wait for instead of
// every worker. Empty when there is none. Returns why the text is invalid.
std::string ParseMembers(const std::string& agreement, int size, std::vector<int>* members) {
  size_t pos = 0;
  while (pos < agreement.size()) {
    size_t end = agreement.find(' ', pos);
    if (end == std::string::npos) end = agreement.size();
    std::string token = agreement.substr(pos, end - pos);
    pos = end + 1;
    if (token.compare(0, 4, "set=") != 0) continue;
    std::string list = token.substr(4);
    size_t at = 0;
    while (at <= list.size()) {
      size_t comma = list.find(',', at);
      if (comma == std::string::npos) comma = list.size();
      std::string item = list.substr(at, comma - at);
      at = comma + 1;
      char* stop = nullptr;
      long r = item.empty() ? -1 : std::strtol(item.c_str(), &stop, 10);
      if (r < 0 || r >= size || *stop != '\0' ||
          (!members->empty() && r <= members->back())) {
        return "process set '" + list + "' is not a rising list of ranks in [0, " +
               std::to_string(size) + ")";
      }
      members->push_back(static_cast<int>(r));
    }
  }
  return "";
}

std::string JoinRanks(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ",") + std::to_string(r);
  return out;
}
}  // namespace

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
  cfg_ = cfg;
  SetLogLevel(cfg.Get("log_level", "WARNING"));
  rank_ = static_cast<int>(cfg.GetInt("rank", 0));
  size_ = static_cast<int>(cfg.GetInt("num_workers", 1));
  num_servers_ = static_cast<int>(cfg.GetInt("num_servers", 0));
  local_rank_ = 0;
  local_size_ = 1;
  cross_rank_ = rank_;  // until the welcome says otherwise: one worker per host
  cross_size_ = size_;
  homogeneous_ = true;
  host_group_ = HostGroup();
  host_group_.ranks = {rank_};
  SetLogIdentity("worker " + std::to_string(rank_));
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
  double rendezvous_s = cfg.GetDouble("rendezvous_timeout_s", 120);
  scheduler_endpoint_ =
      Endpoint(cfg.Get("scheduler_host", "127.0.0.1"), cfg.GetInt("scheduler_port", 0));

  channel_ = MakeZmqChannel(static_cast<int>(cfg.GetInt("zmq_io_threads", 1)), &wake_,
                            LinkSecurity::FromConfig(cfg),
                            static_cast<int>(cfg.GetInt("tcp_notsent_lowat", 0)));
  membership_.reset(new Membership(channel_.get(), Role::kWorker, rank_, heartbeat_s_));
  Config extra;
  extra.Set("local_rank", cfg.Get("local_rank", "-1"));
  extra.Set("local_size", cfg.Get("local_size", "-1"));
  // Which workers can sum through shared memory (local_reduce.h): one
  // machine, one advertised address and one network namespace (the local
  // reduce socket lives in it; namespaced "hosts" of one machine stay apart).
  extra.Set("host_key",
            cfg.Get("hostname") + " " + cfg.Get("advertise_host") + " " + NetnsLink());
  membership_->Join(scheduler_endpoint_, cfg, extra);
  state_ = State::kJoining;
  stop_requested_ = false;
  io_thread_ = std::thread([this] { IoLoop(); });

  bool met = state_cv_.wait_for(lock, std::chrono::duration<double>(rendezvous_s),
                                [this] { return state_ != State::kJoining; });
  if (met && state_ == State::kReady) {
    initialized_ = true;
    BPS_LOG(kInfo, "joined: rank " << rank_ << " of " << size_ << ", " << num_servers_ << " servers");
    return;
  }
  std::string why = !fatal_.empty()
                        ? fatal_
                        : "could not meet the cluster at the scheduler " + scheduler_endpoint_ +
                              " within " + std::to_string(static_cast<int>(rendezvous_s)) +
                              " s: not every worker and server joined (BYTEPS_RENDEZVOUS_TIMEOUT; "
                              "check DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT, that all nodes started, "
                              "and that BYTEPS_JOB_TOKEN and BYTEPS_ENCRYPTION are the same on "
                              "every node)";
  lock.unlock();
  stop_requested_ = true;
  wake_.Notify();
  if (io_thread_.joinable()) io_thread_.join();
  CloseChannel();
  lock.lock();
  state_ = State::kStopped;
  throw Error(why);
}

void WorkerEngine::Shutdown() {
  if (!initialized_) return;
  initialized_ = false;
  if (local_mode_) {
    std::lock_guard<std::mutex> lock(mu_);
    state_ = State::kStopped;
    return;
  }
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

void WorkerEngine::Enqueue(const std::string& name, int dtype, const std::vector<int64_t>& shape,
                           const void* in, void* out, int64_t priority, bps_done_fn done,
                           void* ctx, const std::string& compression,
                           const std::string& agreement, int reduce_op, uint32_t contributors) {
  size_t elem = DTypeSize(dtype);
  if (reduce_op < 0 || reduce_op > kMaxReduceOp) {
    done(ctx, BPS_ERR_INVALID, ("push_pull '" + name + "': unknown reduce op " +
                                std::to_string(reduce_op)).c_str());
    return;
  }
  if (reduce_op != 0 && IsAsyncName(name)) {
    done(ctx, BPS_ERR_INVALID,
         ("push_pull '" + name + "': reduce op " + ReduceOpName(static_cast<uint8_t>(reduce_op)) +
          " is not available for asynchronous keys (the server keeps a running sum)").c_str());
    return;
  }
  if (elem == 0) {
    done(ctx, BPS_ERR_INVALID,
         ("push_pull '" + name + "': unsupported dtype code " + std::to_string(dtype)).c_str());
    return;
  }
  uint64_t count = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      done(ctx, BPS_ERR_INVALID, ("push_pull '" + name + "': negative dimension").c_str());
      return;
    }
    count *= static_cast<uint64_t>(d);
  }
  uint64_t bytes = count * elem;
  CompressorSpec spec;
  try {
    spec = CompressorSpec::Parse(compression);
  } catch (const Error& e) {
    done(ctx, BPS_ERR_INVALID, ("push_pull '" + name + "': " + e.what()).c_str());
    return;
  }
  if (!initialized_) {
    done(ctx, BPS_ERR_NOT_INITIALIZED, "bps_tf is not initialized: call bps_tf.init() first");
    return;
  }
  if (local_mode_) {
    if (in != out && bytes) std::memcpy(out, in, bytes);
    Stats::Get().ops_done++;
    done(ctx, BPS_OK, nullptr);
    return;
  }

  std::vector<int> members;
  std::string bad_set = ParseMembers(agreement, size_, &members);
  if (bad_set.empty() && !members.empty()) {
    if (!std::binary_search(members.begin(), members.end(), rank_)) {
      bad_set = "this worker (rank " + std::to_string(rank_) + ") is not in its process set [" +
                JoinRanks(members) + "]";
    } else if (IsAsyncName(name)) {
      bad_set = "asynchronous keys belong to every worker, not to a process set";
    }
  }
  if (bad_set.empty() && contributors > 0 && (!members.empty() || reduce_op != 0)) {
    // LocalReduce bypasses both: a host sum is a global sum.
    bad_set = "a local-reduce host sum cannot be a process set's or a min/max/product";
  }
  if (!bad_set.empty()) {
    done(ctx, BPS_ERR_INVALID, ("push_pull '" + name + "': " + bad_set).c_str());
    return;
  }

  Task* task = new Task();
  task->name = name;
  task->contributors = static_cast<uint32_t>(members.size());
  if (!members.empty() && members.back() <= kMaxMaskRank) {
    for (int r : members) task->members |= 1ULL << r;
  }
  task->dtype = dtype;
  task->reduce_op = static_cast<uint8_t>(reduce_op);
  task->refuse_joined = agreement.compare(0, 5, "root=") == 0;
  task->bytes = bytes;
  task->in = static_cast<const char*>(in);
  task->out = static_cast<char*>(out);
  task->priority = priority;
  task->done = done;
  task->ctx = ctx;
  if (contributors > 0) task->contributors = contributors;
  // What workers must agree on for this name; the scheduler compares it.
  std::string sig = ShapeString(dtype, shape);
  if (!agreement.empty()) sig += " " + agreement;
  if (reduce_op != 0) {
    // Declared with the shape: workers that reduce a name differently all fail at once.
    sig += std::string(" reduce=") + ReduceOpName(static_cast<uint8_t>(reduce_op));
  }
  // A host sum and a worker's own value never meet in one round.
  if (contributors > 0) sig += " hosts=" + std::to_string(contributors);
  if (Compresses(spec, dtype, bytes)) {
    if (reduce_op != 0) {
      delete task;
      done(ctx, BPS_ERR_INVALID,
           ("push_pull '" + name + "': reduce op " +
            ReduceOpName(static_cast<uint8_t>(reduce_op)) +
            " cannot be combined with compression (a compressor approximates a sum)").c_str());
      return;
    }
    // In the signature, so the scheduler refuses workers that disagree.
    sig += " " + spec.Text();
    task->compressor = std::make_shared<const CompressorSpec>(spec);
  }
  std::string sigkey = name + "|" + sig;
  bool complete_now = false;
  std::string error;
  int status = BPS_ERR_INVALID;
  {
    std::lock_guard<std::mutex> lock(mu_);
    task->seq = next_seq_++;
    if (!fatal_.empty()) {
      error = fatal_;
      status = fatal_status_;
    } else if (!peer_left_.empty() && !IsAsyncName(name)) {
      // An asynchronous key is answered by the server alone: it still works.
      error = "push_pull '" + name + "' cannot complete: " + peer_left_ +
              " has left the job (every worker must make the same push_pulls)";
      status = BPS_ERR_UNAVAILABLE;
    } else if (joining_) {
      error = "push_pull '" + name + "': this worker has called join() and is waiting for the "
              "others; it can make no other call until every worker has joined";
    } else if (names_in_flight_.count(name)) {
      error = "push_pull '" + name +
              "' was started again before the previous one finished; names must be unique "
              "among operations in flight";
    } else {
      names_in_flight_.insert(name);
      if (refuse_joined_names_.count(name)) task->refuse_joined = true;
      auto it = tensors_.find(sigkey);
      if (it != tensors_.end()) {
        if (!it->second->error.empty()) {
          error = it->second->error;
          names_in_flight_.erase(name);
        } else {
          complete_now = ScheduleLocked(task, it->second);
        }
      } else {
        auto& waiters = declaring_[sigkey];
        waiters.push_back(task);
        if (waiters.size() == 1) {
          Config kv;
          kv.Set("name", name);
          kv.Set("sig", sig);
          kv.Set("bytes", std::to_string(bytes));
          kv.Set("dtype", std::to_string(dtype));
          if (!members.empty()) kv.Set("members", JoinRanks(members));
          if (contributors > 0) kv.Set("contributors", std::to_string(contributors));
          uint64_t id = next_request_++;
          request_sig_[id] = sigkey;
          control_outbox_.emplace_back(id, kv.Serialize());
        }
      }
    }
  }
  if (!error.empty()) {
    Stats::Get().ops_failed++;
    delete task;
    done(ctx, status, error.c_str());
    return;
  }
  if (complete_now) {
    Complete(task);
    return;
  }
  wake_.Notify();
}

bool WorkerEngine::Compresses(const CompressorSpec& spec, int dtype, uint64_t bytes) const {
  if (!spec.active() || dtype != BPS_FLOAT32 || bytes < min_compress_bytes_ || bytes == 0) {
    return false;
  }
  // A compressor whose full partition is no smaller than the raw one gains
  // nothing (and would exceed the servers' frame limit).
  uint64_t part = std::min<uint64_t>(bytes, (partition_bytes_ / 4) * 4);
  return CompressedBytes(spec, part / 4) < part;
}

void WorkerEngine::OnDeclared(uint64_t request_id, const Config& kv) {
  std::vector<Task*> finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto rq = request_sig_.find(request_id);
    if (rq == request_sig_.end()) return;
    std::string sigkey = rq->second;
    request_sig_.erase(rq);
    auto info = std::make_shared<TensorInfo>();
    info->error = kv.Get("error");
    if (info->error.empty()) {
      info->key = static_cast<uint64_t>(std::stoull(kv.Get("key", "0")));
      std::string servers = kv.Get("servers");
      size_t pos = 0;
      while (pos < servers.size()) {
        size_t comma = servers.find(',', pos);
        if (comma == std::string::npos) comma = servers.size();
        info->servers.push_back(std::atoi(servers.substr(pos, comma - pos).c_str()));
        pos = comma + 1;
      }
      auto waiters = declaring_[sigkey];
      if (!waiters.empty()) {
        const Task* t = waiters.front();
        uint64_t elem = DTypeSize(t->dtype);
        info->part_bytes = std::max<uint64_t>(elem, (partition_bytes_ / elem) * elem);
      }
    }
    // A refused declaration is not kept: the next call under this name (the
    // workers may agree then) declares again instead of failing at once.
    int refused = kv.Get("mismatch") == "1" ? BPS_ERR_MISMATCH : BPS_ERR_INVALID;
    if (info->error.empty()) tensors_[sigkey] = info;
    for (Task* t : declaring_[sigkey]) {
      if (!info->error.empty()) {
        FailTask(t, refused, info->error);
        finished.push_back(t);
      } else if (ScheduleLocked(t, info)) {
        finished.push_back(t);
      }
    }
    declaring_.erase(sigkey);
  }
  for (Task* t : finished) Complete(t);
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
    channel_->Send(server, h, Msg());
  }
  // The joins this worker's results already counted came before its own:
  // the scheduler must not name any of them as the last to join.
  membership_->Send(MsgType::kJoinNotice, "seen=" + std::to_string(joins_seen_));
  Stats::Get().join_seen_sent = joins_seen_;
  joins_seen_ = 0;
}

}  // namespace bps
