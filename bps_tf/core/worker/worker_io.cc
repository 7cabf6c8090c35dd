// The worker's I/O thread: the only user of its channel. It hands
// declarations to the scheduler, partitions to the servers, replies to their
// tasks, and watches the clocks.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "common/labels.h"
#include "common/stats.h"
#include "transport/fusion.h"
#include "transport/local_links.h"
#include "worker/trace.h"
#include "worker/worker_task.h"

namespace bps {

void WorkerEngine::IoLoop() {
  Message m;
  while (!stop_requested_) {
    // With nothing pending the heartbeat is the only timer: waking twice per
    // beat instead of ten times a second spares an idle worker with many
    // servers most of its polling.
    long wait_ms = static_cast<long>(std::max(1.0, std::min(100.0, heartbeat_s_ * 1000)));
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (state_ == State::kReady && names_in_flight_.empty() && ready_.empty() &&
          in_flight_.empty()) {
        wait_ms = static_cast<long>(std::max(1.0, std::min(500.0, heartbeat_s_ * 500)));
      }
    }
    // Wake up when a hold on sending ends (a fusion cycle, a burst's limit
    // on the credit), to send what it held.
    if (cycle_s_ > 0 || burst_.Enabled()) {
      auto wake_within = [&wait_ms](double s) {
        wait_ms = std::min(wait_ms, static_cast<long>(std::max(1.0, std::ceil(s * 1000))));
      };
      std::lock_guard<std::mutex> lock(mu_);
      if (cycle_s_ > 0 && hold_since_ != Clock::time_point{}) {
        wake_within(cycle_s_ - SecondsSince(hold_since_));
      }
      double burst_left = ready_.empty() ? 0 : BurstLeftLocked();
      if (burst_left > 0) wake_within(burst_left);
    }
    if (!channel_->Wait(wait_ms)) {
      Fatal(ZmqError("polling sockets"), BPS_ERR_INTERNAL);
      break;
    }
    try {
      // Bounded, so a stream of sums that never runs dry still lets the
      // sends, heartbeats and timers run.
      const auto batch = Clock::now();
      for (int handled = 1; channel_->Receive(&m); ++handled) {
        if (membership_->FromScheduler(m)) {
          HandleControl(m);
        } else {
          HandleData(m);
        }
        if (handled % 64 == 0 && SecondsSince(batch) > 0.05) break;
      }
      FlushControl();
      if (!servers_.empty()) SendReadyParts();
      if (!servers_.empty()) SendJoin();
      CheckTimers();
    } catch (const std::exception& e) {
      Fatal(e.what(), BPS_ERR_INTERNAL);
    }
  }
  Leave(leave_reason_);
}

void WorkerEngine::FlushControl() {
  std::vector<std::pair<uint64_t, std::string>> outbox;
  bool leave = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    outbox.swap(control_outbox_);
    std::swap(leave, leave_requested_);
  }
  for (auto& item : outbox) {
    Config kv = Config::Parse(item.second);
    membership_->Send(MsgType::kDeclare, item.second, item.first,
                      static_cast<uint16_t>(kv.GetInt("dtype", 0)));
  }
  if (leave) membership_->Send(MsgType::kLeave, "");
}

bool WorkerEngine::RequestLeave() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!initialized_ || local_mode_ || state_ != State::kReady) return false;
    leave_requested_ = true;
  }
  wake_.Notify();
  return true;
}

void WorkerEngine::HandleData(const Message& m) {
  last_data_ = Clock::now();
  if (m.header.type == static_cast<uint16_t>(MsgType::kJoin)) {
    std::lock_guard<std::mutex> lock(mu_);
    if (joining_) ++join_acks_;
    state_cv_.notify_all();
    return;
  }
  // Only the I/O thread touches joins_seen_ (here and in SendJoin).
  joins_seen_ |= m.header.members;
  if (m.header.type != static_cast<uint16_t>(MsgType::kPullReplyFused)) {
    HandleReply(m.header, m.payload.data(), m.payload.size(), m.delivered);
    return;
  }
  std::vector<FusedView> parts;
  std::string why = ParseFused(m.payload.data(), m.payload.size(), &parts);
  if (!why.empty()) {
    Stats::Get().frames_dropped++;
    BPS_LOG(kWarning, "dropped a reply of server " << m.header.sender << ": " << why);
    return;
  }
  Stats::Get().fused_messages_received++;
  FrameHeader h = m.header;
  h.type = static_cast<uint16_t>(MsgType::kPullReply);
  for (const FusedView& v : parts) {
    h.key = v.part.key;
    h.round = v.part.round;
    h.dtype = v.part.dtype;
    h.request_id = v.part.request_id;
    h.payload_bytes = v.part.payload_bytes;
    HandleReply(h, v.data, v.part.payload_bytes);
  }
}

const WorkerEngine::PartRef* WorkerEngine::Awaiting(const FrameHeader& h) const {
  auto it = in_flight_.find(h.key);
  return it == in_flight_.end() || it->second.task->round != h.round ? nullptr : &it->second;
}

char* WorkerEngine::ReplyDestination(const FrameHeader& h, size_t bytes) {
  const PartRef* p = Awaiting(h);
  if (!p || h.type != static_cast<uint16_t>(MsgType::kPullReply)) return nullptr;
  Task* t = p->task;
  if (t->compressor || bytes != t->PartLength(p->part)) return nullptr;
  return t->out + t->PartOffset(p->part);
}

void WorkerEngine::HandleReply(const FrameHeader& h, const char* data, size_t size,
                               bool delivered) {
  const PartRef* awaited = Awaiting(h);
  if (!awaited) {
    Stats::Get().frames_dropped++;
    return;
  }
  PartRef p = *awaited;
  Task* t = p.task;
  uint64_t len = t->PartLength(p.part);
  in_flight_.erase(h.key);
  if (h.type == static_cast<uint16_t>(MsgType::kPullReply) && t->compressor) {
    PartTimes* times = t->times.empty() ? nullptr : &t->times[p.part];
    if (times) times->replied = Clock::now();
    try {
      Decompress(*t->compressor, data, size, len / sizeof(float),
                 reinterpret_cast<float*>(t->out + t->PartOffset(p.part)));
      Stats::Get().bytes_received += size;
      if (times) {
        times->copied = Clock::now();  // decompressed into the output
        times->server_sum_us = h.request_id;
      }
    } catch (const std::exception& e) {
      FailTask(t, BPS_ERR_INTERNAL, "push_pull '" + t->name + "': the reply of server " +
                                        std::to_string(h.sender) + " does not decompress: " +
                                        e.what());
    }
  } else if (h.type == static_cast<uint16_t>(MsgType::kPullReply) && size == len) {
    PartTimes* times = t->times.empty() ? nullptr : &t->times[p.part];
    if (times) times->replied = Clock::now();
    if (delivered) {
      Stats::Get().replies_decrypted_to_output++;
    } else {
      std::memcpy(t->out + t->PartOffset(p.part), data, len);
    }
    if (times) {
      times->copied = Clock::now();
      times->server_sum_us = h.request_id;  // the server reports its summing time here
    }
    Stats::Get().bytes_received += len;
  } else if (h.type == static_cast<uint16_t>(MsgType::kError)) {
    // Servers refuse a partition only when workers pushed it inconsistently.
    FailTask(t, BPS_ERR_MISMATCH, "push_pull '" + t->name + "': " + std::string(data, size));
  } else {
    FailTask(t, BPS_ERR_INTERNAL, "push_pull '" + t->name + "': malformed reply from server " +
                                      std::to_string(h.sender));
  }
  Release(t, 1);
}

void WorkerEngine::OnWelcome(const Config& w) {
  size_ = static_cast<int>(w.GetInt("num_workers", size_));
  // Elastic: the servers of this epoch (one may have been lost or joined).
  num_servers_ = static_cast<int>(w.GetInt("num_servers", num_servers_));
  // Elastic: the rank the scheduler gave (dense, in the order of the old
  // ranks); otherwise the same as the one this worker said it has.
  rank_ = static_cast<int>(w.GetInt("id", rank_));
  epoch_ = static_cast<uint16_t>(w.GetInt("epoch", 0));
  Stats::Get().elastic_epoch = epoch_;
  Stats::Get().elastic_announced = epoch_;
  SetLogIdentity("worker " + std::to_string(rank_));
  local_rank_ = static_cast<int>(w.GetInt("local_rank", 0));
  local_size_ = static_cast<int>(w.GetInt("local_size", 1));
  cross_rank_ = static_cast<int>(w.GetInt("cross_rank", rank_));
  cross_size_ = static_cast<int>(w.GetInt("cross_size", size_));
  homogeneous_ = w.GetInt("homogeneous", 1) != 0;
  host_group_.num_hosts = static_cast<int>(w.GetInt("num_hosts", size_));
  host_group_.host_index = static_cast<int>(w.GetInt("host_index", rank_));
  host_group_.job_nonce = w.Get("job_nonce");
  host_group_.ranks.clear();
  std::string ranks = w.Get("host_ranks", std::to_string(rank_));
  for (size_t pos = 0; pos < ranks.size();) {
    size_t comma = ranks.find(',', pos);
    if (comma == std::string::npos) comma = ranks.size();
    host_group_.ranks.push_back(std::atoi(ranks.substr(pos, comma - pos).c_str()));
    pos = comma + 1;
  }
  // The epoch keeps a restarted membership's links apart from the old ones.
  std::string id = "data-worker-" + std::to_string(rank_) + "-" + std::to_string(getpid()) +
                   (epoch_ ? "-e" + std::to_string(epoch_) : "");
  const std::string machine = enable_ipc_ ? MachineNetnsId() : "";
  const std::set<std::string> listed =
      machine.empty() ? std::set<std::string>() : ListedServerSockets(w, num_servers_, machine);
  server_ids_.clear();
  for (int s = 0; s < num_servers_; ++s) {
    bool local = false;
    std::string endpoint = ServerEndpoint(w, s, machine, &local, &listed);
    if (local) Stats::Get().links_local++;
    servers_.push_back(channel_->Connect(endpoint, id));
    server_ids_.push_back(static_cast<int>(w.GetInt("server." + std::to_string(s) + ".id", s)));
  }
}

bool WorkerEngine::ServerGone(int server, const std::string& why) {
  if (!elastic_) return false;
  // Elastic: a lost server is a membership change (scheduler_servers.cc).
  // This worker saw it first (its link to the server broke): it tells the
  // scheduler, which starts the next epoch without waiting for
  // BYTEPS_TIMEOUT, and returns to its commit at once.
  int id = server >= 0 && server < static_cast<int>(server_ids_.size()) ? server_ids_[server]
                                                                       : server;
  Config notice;
  notice.Set("server", std::to_string(id));
  notice.Set("epoch", std::to_string(epoch_));
  notice.Set("why", why);
  membership_->Send(MsgType::kPeerLeft, notice.Serialize());
  Stats::Get().elastic_announced = epoch_ + 1u;
  Fatal("bps_tf: the workers changed (server " + std::to_string(id) + " is gone: " + why +
            "); this operation was dropped: catch it with bps_tf.elastic.run "
            "(WorkersChangedError) and restore the last commit",
        BPS_ERR_UNAVAILABLE, /*peer_failure=*/false);
  return true;
}

void WorkerEngine::HandleControl(const Message& m) {
  if (membership_->Handle(m, [this](const Config& w) { OnWelcome(w); })) {
    if (membership_->ready()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (state_ == State::kJoining) state_ = State::kReady;
      state_cv_.notify_all();
    }
    return;
  }
  switch (static_cast<MsgType>(m.header.type)) {
    case MsgType::kDeclared:
      OnDeclared(m.header.request_id, Config::Parse(m.payload.str()));
      break;
    case MsgType::kError:
      Fatal(m.payload.str(), BPS_ERR_UNAVAILABLE);
      break;
    case MsgType::kWorkersChanged: {
      // Elastic: every operation of this epoch fails (none can complete
      // with the old worker count); the program restarts its membership.
      Config kv = Config::Parse(m.payload.str());
      Stats::Get().elastic_announced = static_cast<uint64_t>(kv.GetInt("epoch", epoch_ + 1));
      Fatal("bps_tf: the workers changed (membership epoch " + kv.Get("epoch") + ": " +
                kv.Get("why") + "); this operation was dropped: catch it with "
                "bps_tf.elastic.run (WorkersChangedError) and restore the last commit",
            BPS_ERR_UNAVAILABLE, /*peer_failure=*/false);
      break;
    }
    case MsgType::kHostsUpdated: {
      // Elastic: workers were added or will leave; hvd.elastic's states read
      // these updates and raise HostsUpdatedInterrupt at the next commit.
      Config kv = Config::Parse(m.payload.str());
      Stats::Get().elastic_waiting = static_cast<uint64_t>(kv.GetInt("waiting", 1));
      Stats::Get().AddHostUpdate(static_cast<uint64_t>(kv.GetInt("seq", 0)),
                                 kv.GetInt("time_ms", 0), static_cast<int>(kv.GetInt("flags", 2)));
      break;
    }
    case MsgType::kLeave: {
      // Elastic: this worker is removed (its host left the job, or it asked
      // to leave). A member leaves at the next commit, when every worker
      // restarts (hvd.elastic.run); a worker that is not one yet goes now.
      std::string why = Config::Parse(m.payload.str()).Get("why", "removed from the job");
      Stats::Get().SetElasticLeave(why);
      if (!membership_->welcomed()) {
        Fatal("bps_tf: this worker leaves the elastic job: " + why, BPS_ERR_UNAVAILABLE,
              /*peer_failure=*/false);
      }
      break;
    }
    case MsgType::kJoinNotice: {
      std::lock_guard<std::mutex> lock(mu_);
      if (joining_) join_last_ = static_cast<int>(Config::Parse(m.payload.str()).GetInt("last", 0));
      state_cv_.notify_all();
      break;
    }
    case MsgType::kStall: {
      // The scheduler knows keys only: this worker adds its variable names
      // and what its program is doing, which the scheduler cannot know.
      std::string message = m.payload.str();
      BPS_LOG(kWarning, message << TensorLabels::Get().QuotedLabels(message)
                                << TensorLabels::Get().WhileDoing());
      break;
    }
    case MsgType::kPeerLeft: {
      std::lock_guard<std::mutex> lock(mu_);
      if (peer_left_.empty()) {
        peer_left_ = PeerLeftText(Config::Parse(m.payload.str()));
        peer_left_at_ = Clock::now();
      }
      break;
    }
    default:
      break;
  }
}

// What the others are told when a worker leaves: its reason when it gave
// one (interrupted, failed), else that it finished while they still need it.
std::string WorkerEngine::PeerLeftText(const Config& left) {
  std::string who = left.Get("who", "another worker");
  std::string reason = left.Get("reason");
  if (!reason.empty()) return who + " " + reason + " and has left the job";
  return who + " has left the job: it shut down while this worker still makes push_pulls "
               "(every worker must make the same push_pulls, e.g. train the same number of steps)";
}

void WorkerEngine::CheckTimers() {
  membership_->Tick();
  State state;
  std::string left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    state = state_;
    if (!peer_left_.empty() &&
        SecondsSince(std::max(peer_left_at_, last_data_)) > kPeerLeftGraceS) {
      // Asynchronous keys need no partner (protocol.h): only the others fail.
      for (const std::string& name : names_in_flight_) {
        if (!IsAsyncName(name)) {
          left = peer_left_;
          break;
        }
      }
    }
  }
  std::string refused = channel_->Refusal();
  if (!refused.empty()) {
    Fatal((state == State::kJoining ? "could not meet the cluster: " : "worker " +
                                      std::to_string(rank_) + ": ") + refused,
          BPS_ERR_UNAVAILABLE);
    return;
  }
  if (!left.empty()) {
    // Operations still pending after a partner left can never complete.
    Fatal("push_pull cannot complete: " + left, BPS_ERR_UNAVAILABLE, /*peer_failure=*/false);
    return;
  }
  if (elastic_ && (state == State::kReady || state == State::kJoining) && RelinkIfLost(state)) {
    return;
  }
  if (state == State::kReady && membership_->Silent(timeout_s_)) {
    Fatal("worker " + std::to_string(rank_) + " lost contact with the scheduler at " +
              scheduler_endpoint_ + ": nothing heard for " +
              std::to_string(static_cast<int>(timeout_s_)) + " s (BYTEPS_TIMEOUT)",
          BPS_ERR_UNAVAILABLE);
    return;
  }
  // The limits are seconds; the I/O loop wakes for every message.
  if (state == State::kReady && SecondsSince(stall_scanned_) >= 0.25) {
    stall_scanned_ = Clock::now();
    CheckStalledPushes();
  }
}

bool WorkerEngine::RelinkIfLost(State state) {
  bool lost = membership_->Dropped() ||
              ((state == State::kReady || membership_->relinking()) &&
               membership_->Silent(timeout_s_));
  if (!lost) return false;
  if (membership_->relinking() &&
      SecondsSince(membership_->relink_started()) > recovery_s_) {
    Fatal("worker " + std::to_string(rank_) + " lost contact with the scheduler at " +
              scheduler_endpoint_ + ", and it did not come back within " +
              std::to_string(static_cast<int>(recovery_s_)) +
              " s (BYTEPS_SCHEDULER_RECOVERY_TIMEOUT)",
          BPS_ERR_UNAVAILABLE);
    return true;
  }
  // What a restarted scheduler rebuilds the membership from
  // (scheduler_recover.cc); this engine goes on meanwhile: the servers
  // still sum the rounds of this epoch.
  Config report;
  report.Set("recover", "1");
  report.Set("epoch", std::to_string(epoch_));
  report.Set("welcomed", membership_->welcomed() ? "1" : "0");
  report.Set("size", std::to_string(membership_->welcomed() ? size_ : 0));
  report.Set("servers", std::to_string(membership_->welcomed() ? num_servers_ : 0));
  BPS_LOG(kWarning, (membership_->relinking() ? "still no answer from" : "lost")
                        << " the scheduler at " << scheduler_endpoint_
                        << "; re-registering (it may be restarting; up to "
                        << static_cast<int>(recovery_s_)
                        << " s, BYTEPS_SCHEDULER_RECOVERY_TIMEOUT)");
  membership_->Relink(report);
  return true;
}

// A name's first push_pull waits at the scheduler, whose stall check names
// the missing workers. A later round of a name is sent at once, so a worker
// that skips it (a call under a rank-dependent branch) leaves the others'
// pushes waiting at the servers: reported here from the waiting side.
void WorkerEngine::CheckStalledPushes() {
  for (auto& kv : in_flight_) {
    Task* task = kv.second.task;
    if (IsAsyncName(task->name)) continue;   // never waits for other workers
    double age = SecondsSince(task->start);
    if (op_timeout_s_ > 0 && age > op_timeout_s_) {
      Fatal(TensorLabels::Get().Annotate(
                task->name, "push_pull '" + task->name + "' did not complete within " +
                                std::to_string(static_cast<int>(op_timeout_s_)) +
                                " s (BYTEPS_OP_TIMEOUT): another worker did not push it" +
                                TensorLabels::Get().WhileDoing()),
            BPS_ERR_TIMEOUT);
      return;
    }
    if (stall_check_s_ <= 0 || age < stall_check_s_) continue;
    std::string label = TensorLabels::Get().Of(task->name);
    std::string what = "push_pull '" + task->name + "'" +
                       (label.empty() ? "" : " (variable " + label + ")") + " (call " +
                       std::to_string(task->round + 1) + " of this name) has waited " +
                       std::to_string(static_cast<int>(age)) + " s for the other workers" +
                       TensorLabels::Get().WhileDoing() +
                       ": a worker skipped this call (every worker must make the same "
                       "push_pull/broadcast calls) or is stuck elsewhere";
    if (op_timeout_s_ <= 0 && stall_shutdown_s_ > 0 && age >= stall_shutdown_s_) {
      Fatal(what + "; stopping after BYTEPS_STALL_SHUTDOWN_TIME_SECONDS=" +
                std::to_string(static_cast<int>(stall_shutdown_s_)),
            BPS_ERR_TIMEOUT);
      return;
    }
    if (!task->stall_warned) {
      task->stall_warned = true;
      BPS_LOG(kWarning, what << " (BYTEPS_STALL_CHECK_TIME_SECONDS="
                             << static_cast<int>(stall_check_s_) << ")");
    }
  }
}

void WorkerEngine::Leave(const std::string& reason) {
  bool ready;
  std::string why = reason;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // A worker that failed still says goodbye while the scheduler answers,
    // so the job ends at once, and with a reason: it did not finish,
    // whatever its program says.
    ready = state_ == State::kReady ||
            (state_ == State::kFailed && membership_->welcomed() &&
             !membership_->Silent(2 * heartbeat_s_ + 1));
    if (why.empty() && !fatal_.empty()) why = "stopped after an error (" + fatal_ + ")";
  }
  Fatal("bps_tf was shut down", BPS_ERR_UNAVAILABLE, /*peer_failure=*/false);
  std::string trace = Trace::Get().Flush();
  if (!trace.empty()) BPS_LOG(kInfo, "timeline written to " << trace);
  if (ready) {
    membership_->Leave(2000, why);  // let the goodbye reach the scheduler
  } else {
    membership_->Close();
  }
}

}  // namespace bps
