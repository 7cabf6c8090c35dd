#include "worker_engine.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "auth.h"
#include "stats.h"
#include "trace.h"

namespace bps {

struct WorkerEngine::TensorInfo {
  uint64_t key = 0;
  std::vector<int> servers;  // server of each partition
  uint64_t part_bytes = 0;
  uint64_t next_round = 0;
  std::string error;
};

struct WorkerEngine::Task {
  std::string name;
  int dtype = 0;
  uint64_t bytes = 0;
  const char* in = nullptr;
  char* out = nullptr;
  int64_t priority = 0;
  uint64_t seq = 0;
  bps_done_fn done = nullptr;
  void* ctx = nullptr;
  std::shared_ptr<TensorInfo> info;
  uint64_t round = 0;
  uint32_t first_part = 0;  // where this worker starts among the partitions
  // Two counts per partition: its reply (or abandonment) and libzmq
  // releasing the zero-copy input buffer. done() runs when both are in.
  std::atomic<int> remaining{0};
  std::atomic<bool> failed{false};
  std::mutex error_mu;
  std::string error;
  Clock::time_point start = Clock::now();
  Clock::time_point scheduled{};
  std::vector<PartTimes> times;  // filled only when this round is traced

  uint64_t PartOffset(uint32_t part) const { return part * info->part_bytes; }
  uint64_t PartLength(uint32_t part) const {
    return std::min<uint64_t>(info->part_bytes, bytes - PartOffset(part));
  }
};

bool WorkerEngine::Order::operator()(const PartRef& a, const PartRef& b) const {
  // std::priority_queue pops the largest: higher priority, then older task,
  // then the partition order of this worker (which starts at first_part).
  if (a.task->priority != b.task->priority) return a.task->priority < b.task->priority;
  if (a.task->seq != b.task->seq) return a.task->seq > b.task->seq;
  size_t n = a.task->info->servers.size();
  return (a.part + n - a.task->first_part) % n > (b.part + n - b.task->first_part) % n;
}

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
  SetLogIdentity("worker " + std::to_string(rank_));
  // A new cluster after shutdown(): nothing learned from the old one holds.
  tensors_.clear();
  declaring_.clear();
  request_sig_.clear();
  names_in_flight_.clear();
  peer_left_.clear();
  sends_paused_ = false;
  SetJobToken(cfg.Get("job_token"));
  Trace::Get().Configure(cfg.GetInt("trace_on", 0) != 0, cfg.Get("trace_dir", "."), rank_,
                         cfg.GetInt("trace_start_step", 0), cfg.GetInt("trace_end_step", 20));
  fatal_.clear();
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

  partition_bytes_ = static_cast<uint64_t>(cfg.GetInt("partition_bytes", 4096000));
  if (partition_bytes_ < 8) throw Error("BYTEPS_PARTITION_BYTES must be at least 8");
  int64_t credit = cfg.GetInt("credit_bytes", 0);
  credit_bytes_ = credit > 0 ? static_cast<uint64_t>(credit) : 8 * partition_bytes_;
  timeout_s_ = cfg.GetDouble("timeout_s", 30);
  heartbeat_s_ = cfg.GetDouble("heartbeat_s", 1);
  op_timeout_s_ = cfg.GetDouble("op_timeout_s", 0);
  fatal_exit_s_ = cfg.GetDouble("fatal_exit_s", 15);
  double rendezvous_s = cfg.GetDouble("rendezvous_timeout_s", 120);
  scheduler_endpoint_ =
      Endpoint(cfg.Get("scheduler_host", "127.0.0.1"), cfg.GetInt("scheduler_port", 0));

  ctx_.reset(new Context(static_cast<int>(cfg.GetInt("zmq_io_threads", 1))));
  control_.reset(new Socket(*ctx_, zmqc::kDealer,
                            "ctl-worker-" + std::to_string(rank_) + "-" + std::to_string(getpid())));
  control_->Connect(scheduler_endpoint_);
  Config hello;
  for (const char* key : kSharedSettings) {
    hello.Set(key, cfg.Get(key));
  }
  hello.Set("hostname", cfg.Get("hostname"));
  hello.Set("pid", std::to_string(getpid()));
  hello.Set("local_rank", cfg.Get("local_rank", "-1"));
  hello.Set("local_size", cfg.Get("local_size", "-1"));
  state_ = State::kJoining;
  stop_requested_ = false;
  join_started_ = last_heard_ = last_beat_ = Clock::now();
  SendControl(MsgType::kHello, hello.Serialize());
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
                              "and that BYTEPS_JOB_TOKEN is the same on every node)";
  lock.unlock();
  stop_requested_ = true;
  wake_.Notify();
  if (io_thread_.joinable()) io_thread_.join();
  control_.reset();
  data_.clear();
  ctx_.reset();
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
  control_.reset();
  data_.clear();
  ctx_.reset();
  std::lock_guard<std::mutex> lock(mu_);
  state_ = State::kStopped;
}

void WorkerEngine::Enqueue(const std::string& name, int dtype, const std::vector<int64_t>& shape,
                           const void* in, void* out, int64_t priority, bps_done_fn done,
                           void* ctx) {
  size_t elem = DTypeSize(dtype);
  if (elem == 0) {
    done(ctx, 0, ("push_pull '" + name + "': unsupported dtype code " + std::to_string(dtype)).c_str());
    return;
  }
  uint64_t count = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      done(ctx, 0, ("push_pull '" + name + "': negative dimension").c_str());
      return;
    }
    count *= static_cast<uint64_t>(d);
  }
  uint64_t bytes = count * elem;
  if (!initialized_) {
    done(ctx, 0, "bps_tf is not initialized: call bps_tf.init() first");
    return;
  }
  if (local_mode_) {
    if (in != out && bytes) std::memcpy(out, in, bytes);
    Stats::Get().ops_done++;
    done(ctx, 1, nullptr);
    return;
  }

  Task* task = new Task();
  task->name = name;
  task->dtype = dtype;
  task->bytes = bytes;
  task->in = static_cast<const char*>(in);
  task->out = static_cast<char*>(out);
  task->priority = priority;
  task->done = done;
  task->ctx = ctx;
  std::string sig = ShapeString(dtype, shape);
  std::string sigkey = name + "|" + sig;
  bool complete_now = false;
  std::string error;
  {
    std::lock_guard<std::mutex> lock(mu_);
    task->seq = next_seq_++;
    if (!fatal_.empty()) {
      error = fatal_;
    } else if (!peer_left_.empty()) {
      error = "push_pull '" + name + "' cannot complete: " + peer_left_ +
              " has left the job (every worker must make the same push_pulls)";
    } else if (names_in_flight_.count(name)) {
      error = "push_pull '" + name +
              "' was started again before the previous one finished; names must be unique "
              "among operations in flight";
    } else {
      names_in_flight_.insert(name);
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
    done(ctx, 0, error.c_str());
    return;
  }
  if (complete_now) {
    Complete(task);
    return;
  }
  wake_.Notify();
}

void WorkerEngine::PauseSends(bool paused) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    sends_paused_ = paused;
  }
  wake_.Notify();
}

bool WorkerEngine::ScheduleLocked(Task* task, const std::shared_ptr<TensorInfo>& info) {
  task->info = info;
  task->round = info->next_round++;
  task->scheduled = Clock::now();
  size_t parts = info->servers.size();
  // Workers start a large tensor at different partitions, so they do not all
  // feed the same server's link at the same moment.
  task->first_part = static_cast<uint32_t>(parts * static_cast<size_t>(rank_) /
                                           static_cast<size_t>(std::max(size_, 1)));
  if (Trace::Get().Wants(task->round)) task->times.resize(parts);
  task->remaining = static_cast<int>(2 * parts);
  for (uint32_t p = 0; p < parts; ++p) ready_.push(PartRef{task, p});
  return parts == 0;
}

void WorkerEngine::FailTask(Task* task, const std::string& why) {
  std::lock_guard<std::mutex> lock(task->error_mu);
  if (task->error.empty()) task->error = why;
  task->failed = true;
}

void WorkerEngine::Release(Task* task, int count) {
  if (task->remaining.fetch_sub(count) == count) Complete(task);
}

void WorkerEngine::Complete(Task* task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    names_in_flight_.erase(task->name);
  }
  std::string error;
  {
    std::lock_guard<std::mutex> lock(task->error_mu);
    error = task->error;
  }
  if (error.empty() && task->info && Trace::Get().Wants(task->round)) {
    Trace::Get().RecordOperation(task->name, task->priority, task->round, task->bytes,
                                 task->start, task->scheduled, Clock::now(), task->times);
  }
  if (error.empty()) {
    Stats::Get().ops_done++;
    task->done(task->ctx, 1, nullptr);
  } else {
    Stats::Get().ops_failed++;
    task->done(task->ctx, 0, error.c_str());
  }
  delete task;
}

namespace {
// What libzmq hands back when it no longer needs a partition's bytes.
struct SentPart {
  WorkerEngine::Task* task;
  uint64_t bytes;
  uint32_t part;
};
}  // namespace

void WorkerEngine::FreePart(void*, void* hint) {
  SentPart* sent = static_cast<SentPart*>(hint);
  WorkerEngine& engine = WorkerEngine::Get();
  // The credit counts bytes not yet taken by the kernel: it keeps libzmq's
  // queue short so urgent partitions can overtake, without waiting for the
  // other workers (which could deadlock if workers chose different orders).
  engine.credit_released_ += sent->bytes;
  engine.wake_.Notify();
  Task* task = sent->task;
  if (!task->times.empty()) task->times[sent->part].released = Clock::now();
  delete sent;
  engine.Release(task, 1);
}

void WorkerEngine::SendControl(MsgType type, const std::string& payload, uint64_t request_id) {
  FrameHeader h = MakeHeader(type, Role::kWorker, rank_);
  h.request_id = request_id;
  auto frames = MakeFrames(h, payload);
  control_->SendFrames(&frames);
}

void WorkerEngine::FlushControl() {
  std::vector<std::pair<uint64_t, std::string>> outbox;
  {
    std::lock_guard<std::mutex> lock(mu_);
    outbox.swap(control_outbox_);
  }
  for (auto& item : outbox) {
    Config kv = Config::Parse(item.second);
    FrameHeader h = MakeHeader(MsgType::kDeclare, Role::kWorker, rank_);
    h.request_id = item.first;
    h.dtype = static_cast<uint16_t>(kv.GetInt("dtype", 0));
    auto frames = MakeFrames(h, item.second);
    control_->SendFrames(&frames);
  }
}

void WorkerEngine::SendReadyParts() {
  std::vector<PartRef> to_send;
  std::vector<Task*> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (!ready_.empty()) {
      PartRef p = ready_.top();
      if (p.task->failed) {
        ready_.pop();
        dropped.push_back(p.task);
        continue;
      }
      uint64_t len = p.task->PartLength(p.part);
      uint64_t in_flight = credit_handed_ - credit_released_.load();
      if (sends_paused_ || (in_flight > 0 && in_flight + len > credit_bytes_)) break;
      ready_.pop();
      credit_handed_ += len;
      to_send.push_back(p);
    }
  }
  for (Task* t : dropped) Release(t, 2);
  bool log = Stats::Get().send_log_on;
  for (size_t i = 0; i < to_send.size(); ++i) {
    const PartRef& p = to_send[i];
    Task* t = p.task;
    uint64_t off = t->PartOffset(p.part);
    uint64_t len = t->PartLength(p.part);
    uint64_t key = PartKey(t->info->key, p.part);
    FrameHeader h = MakeHeader(MsgType::kPush, Role::kWorker, rank_);
    h.key = key;
    h.round = t->round;
    h.dtype = static_cast<uint16_t>(t->dtype);
    in_flight_[key] = p;
    if (log) Stats::Get().RecordSend(t->name, p.part, t->priority);
    if (!t->times.empty()) t->times[p.part].sent = Clock::now();
    auto frames = MakeFrames(h, Msg(const_cast<char*>(t->in) + off, len, &FreePart,
                                    new SentPart{t, len, p.part}));
    int server = t->info->servers[p.part];
    if (!data_[static_cast<size_t>(server)]->SendFrames(&frames)) {
      std::string why = "sending to server " + std::to_string(server) + " failed: " +
                        zmq_strerror(zmq_errno());
      for (size_t j = i + 1; j < to_send.size(); ++j) {
        FailTask(to_send[j].task, why);
        Release(to_send[j].task, 2);
      }
      Fatal(why);
      return;
    }
    Stats::Get().partitions_sent++;
    Stats::Get().bytes_sent += len;
  }
}

namespace {
// A [header][payload] message from a peer; false (and counted) if malformed.
bool ParseReply(std::vector<Msg>& frames, FrameHeader* h) {
  if (frames.size() != 2 ||
      !ValidateHeader(frames[0].data(), frames[0].size(), frames[1].size()).empty()) {
    Stats::Get().frames_dropped++;
    return false;
  }
  std::memcpy(h, frames[0].data(), sizeof(*h));
  return true;
}
}  // namespace

void WorkerEngine::HandleData(std::vector<Msg>& frames) {
  FrameHeader h;
  if (!ParseReply(frames, &h)) return;
  auto it = in_flight_.find(h.key);
  if (it == in_flight_.end() || it->second.task->round != h.round) {
    Stats::Get().frames_dropped++;
    return;
  }
  PartRef p = it->second;
  Task* t = p.task;
  uint64_t len = t->PartLength(p.part);
  in_flight_.erase(it);
  if (h.type == static_cast<uint16_t>(MsgType::kPullReply) && frames[1].size() == len) {
    PartTimes* times = t->times.empty() ? nullptr : &t->times[p.part];
    if (times) times->replied = Clock::now();
    std::memcpy(t->out + t->PartOffset(p.part), frames[1].data(), len);
    if (times) {
      times->copied = Clock::now();
      times->server_sum_us = h.request_id;  // the server reports its summing time here
    }
    Stats::Get().bytes_received += len;
  } else if (h.type == static_cast<uint16_t>(MsgType::kError)) {
    FailTask(t, "push_pull '" + t->name + "': " + frames[1].str());
  } else {
    FailTask(t, "push_pull '" + t->name + "': malformed reply from server " +
                    std::to_string(h.sender));
  }
  Release(t, 1);
}

void WorkerEngine::OnWelcome(const Config& w) {
  size_ = static_cast<int>(w.GetInt("num_workers", size_));
  local_rank_ = static_cast<int>(w.GetInt("local_rank", 0));
  local_size_ = static_cast<int>(w.GetInt("local_size", 1));
  std::string id = "data-worker-" + std::to_string(rank_) + "-" + std::to_string(getpid());
  for (int s = 0; s < num_servers_; ++s) {
    std::string addr = w.Get("server." + std::to_string(s));
    data_.emplace_back(new Socket(*ctx_, zmqc::kDealer, id));
    data_.back()->Connect(addr);
  }
  SendControl(MsgType::kBarrier, "");
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
    tensors_[sigkey] = info;
    for (Task* t : declaring_[sigkey]) {
      if (!info->error.empty()) {
        FailTask(t, info->error);
        finished.push_back(t);
      } else if (ScheduleLocked(t, info)) {
        finished.push_back(t);
      }
    }
    declaring_.erase(sigkey);
  }
  for (Task* t : finished) Complete(t);
}

void WorkerEngine::HandleControl(std::vector<Msg>& frames) {
  FrameHeader h;
  if (!ParseReply(frames, &h)) return;
  last_heard_ = Clock::now();
  switch (static_cast<MsgType>(h.type)) {
    case MsgType::kWelcome:
      OnWelcome(Config::Parse(frames[1].str()));
      break;
    case MsgType::kBarrierDone: {
      std::lock_guard<std::mutex> lock(mu_);
      if (state_ == State::kJoining) state_ = State::kReady;
      state_cv_.notify_all();
      break;
    }
    case MsgType::kDeclared:
      OnDeclared(h.request_id, Config::Parse(frames[1].str()));
      break;
    case MsgType::kError:
      Fatal(frames[1].str());
      break;
    case MsgType::kPeerLeft: {
      // In async mode nobody waits for a partner: a departure changes nothing.
      if (cfg_.GetInt("async", 0) != 0) break;
      std::lock_guard<std::mutex> lock(mu_);
      if (peer_left_.empty()) {
        peer_left_ = frames[1].str();
        peer_left_at_ = Clock::now();
      }
      break;
    }
    default:
      break;
  }
}

void WorkerEngine::Fatal(const std::string& message, bool peer_failure) {
  std::vector<Task*> finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!fatal_.empty()) return;
    fatal_ = message;
    if (peer_failure) BPS_LOG(kError, message);
    for (auto& d : declaring_) {
      for (Task* t : d.second) {
        FailTask(t, message);
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
    FailTask(kv.second.task, message);
    abandoned.push_back(kv.second.task);
  }
  in_flight_.clear();
  std::vector<Task*> unsent;
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (!ready_.empty()) {
      FailTask(ready_.top().task, message);
      unsent.push_back(ready_.top().task);
      ready_.pop();
    }
  }
  for (Task* t : abandoned) Release(t, 1);  // the reply will not come
  for (Task* t : unsent) Release(t, 2);     // neither sent nor replied
  // Closing the data sockets drops their queued frames, so libzmq releases
  // every input buffer and the remaining counts reach zero.
  data_.clear();
}

void WorkerEngine::CheckTimers() {
  if (SecondsSince(last_beat_) >= heartbeat_s_) {
    last_beat_ = Clock::now();
    SendControl(MsgType::kHeartbeat, "");
  }
  State state;
  std::string left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    state = state_;
    if (!peer_left_.empty() && SecondsSince(peer_left_at_) > kPeerLeftGraceS &&
        (!in_flight_.empty() || !ready_.empty() || !declaring_.empty())) {
      left = peer_left_;
    }
  }
  if (!left.empty()) {
    // Operations still pending after a partner left can never complete.
    Fatal("push_pull cannot complete: " + left + " has left the job", /*peer_failure=*/false);
    return;
  }
  if (state == State::kReady && SecondsSince(last_heard_) > timeout_s_) {
    Fatal("worker " + std::to_string(rank_) + " lost contact with the scheduler at " +
          scheduler_endpoint_ + ": nothing heard for " +
          std::to_string(static_cast<int>(timeout_s_)) + " s (BYTEPS_TIMEOUT)");
    return;
  }
  if (op_timeout_s_ > 0 && state == State::kReady) {
    for (auto& kv : in_flight_) {
      if (SecondsSince(kv.second.task->start) > op_timeout_s_) {
        Fatal("push_pull '" + kv.second.task->name + "' did not complete within " +
              std::to_string(static_cast<int>(op_timeout_s_)) +
              " s (BYTEPS_OP_TIMEOUT): another worker did not push it");
        return;
      }
    }
  }
}

void WorkerEngine::Leave() {
  bool ready;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ready = state_ == State::kReady;
  }
  Fatal("bps_tf was shut down", /*peer_failure=*/false);
  std::string trace = Trace::Get().Flush();
  if (!trace.empty()) BPS_LOG(kInfo, "timeline written to " << trace);
  if (ready && control_) {
    SendControl(MsgType::kBye, "");
    control_->SetLinger(2000);  // let the goodbye reach the scheduler
  }
  control_.reset();
}

void WorkerEngine::IoLoop() {
  std::vector<Msg> frames;
  std::vector<zmq_pollitem_t> items;
  while (!stop_requested_) {
    items.clear();
    items.push_back({nullptr, wake_.fd(), zmqc::kPollIn, 0});
    items.push_back({control_->get(), 0, zmqc::kPollIn, 0});
    for (auto& s : data_) items.push_back({s->get(), 0, zmqc::kPollIn, 0});
    long wait_ms = static_cast<long>(std::max(1.0, std::min(100.0, heartbeat_s_ * 1000)));
    if (zmq_poll(items.data(), static_cast<int>(items.size()), wait_ms) < 0 &&
        zmq_errno() != EINTR) {
      Fatal(ZmqError("polling sockets"));
      break;
    }
    if (items[0].revents) wake_.Drain();
    try {
      while (control_->RecvFrames(&frames)) HandleControl(frames);
      for (size_t s = 0; s < data_.size(); ++s) {
        while (s < data_.size() && data_[s]->RecvFrames(&frames)) HandleData(frames);
      }
      FlushControl();
      if (!data_.empty()) SendReadyParts();
      CheckTimers();
    } catch (const std::exception& e) {
      Fatal(e.what());
    }
  }
  Leave();
}

}  // namespace bps
