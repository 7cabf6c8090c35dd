// The scheduler's meeting place: HELLO and its checks, the barrier,
// heartbeats and departures. The WELCOME with the cluster's layout is in
// scheduler_welcome.cc; tensor declarations, join and stall checks are in
// scheduler_declare.cc.
#include "scheduler/scheduler.h"

#include <algorithm>
#include <cstdlib>

namespace bps {

namespace {

// What to do about a setting that differs between the scheduler and a node
// (`who`, whose HELLO is `kv`). The cluster's size is named in each side's
// own terms (TF_CONFIG's lists, bpslaunch's options, DMLC_*: see
// bps_tf/runtime/origins.py), every other setting by its variable.
std::string SameEverywhere(const SharedSetting& s, const Config& cfg, const std::string& who,
                           const Config& kv) {
  std::string key = s.key;
  if (key != "num_workers" && key != "num_servers") {
    return std::string("set it the same on every node: ") + s.env;
  }
  std::string mine = cfg.Get("members_origin", "DMLC_NUM_WORKER/DMLC_NUM_SERVER");
  std::string theirs = kv.Get("members_origin", mine);
  if (theirs == mine) return "every node must be given the same " + mine;
  return "the scheduler's comes from " + mine + ", " + who + "'s from " + theirs +
         ": make them describe the same cluster";
}

}  // namespace

int Scheduler::KvInt(const Config& kv, const std::string& key, int dflt) {
  try {
    return static_cast<int>(kv.GetInt(key, dflt));
  } catch (const Error&) {
    return dflt;
  }
}

Scheduler::Scheduler(const Config& cfg)
    : cfg_(cfg),
      num_workers_(static_cast<int>(cfg.GetInt("num_workers", 1))),
      num_servers_(static_cast<int>(cfg.GetInt("num_servers", 1))),
      partition_bytes_(cfg.GetInt("partition_bytes", kDefaultPartitionBytes)),
      timeout_s_(cfg.GetDouble("timeout_s", 30)),
      stall_check_s_(cfg.GetDouble("stall_check_s", 60)),
      stall_shutdown_s_(cfg.GetDouble("stall_shutdown_s", 600)),
      server_load_(static_cast<size_t>(std::max(num_servers_, 1)), 0),
      report_every_s_(std::min(10.0, std::max(1.0, cfg.GetDouble("rendezvous_timeout_s", 120) / 3))),
      rendezvous_s_(cfg.GetDouble("rendezvous_timeout_s", 120)),
      elastic_(cfg.GetInt("elastic", 0) != 0),
      min_workers_(static_cast<int>(cfg.GetInt("elastic_min_workers", 1))),
      max_workers_(static_cast<int>(cfg.GetInt("elastic_max_workers", 0))),
      elastic_timeout_s_(cfg.GetDouble("elastic_timeout_s", 600)),
      reset_limit_(static_cast<int>(cfg.GetInt("elastic_reset_limit", -1))),
      newcomer_wait_s_(cfg.GetDouble("rendezvous_timeout_s", 120)) {
  if (max_workers_ <= 0) max_workers_ = std::max(num_workers_, 1);
  min_workers_ = std::max(1, std::min(min_workers_, max_workers_));
}

Outgoing Scheduler::Reply(const Peer& to, MsgType type, const std::string& payload,
                          uint64_t request_id) {
  Outgoing o;
  o.to = to;
  o.header = MakeHeader(type, Role::kScheduler, -1);
  o.header.request_id = request_id;
  o.payload = payload;
  return o;
}

std::string Scheduler::Describe(const Node& n) const {
  std::string s = std::string(RoleName(n.role)) + " " + std::to_string(n.id);
  if (!n.hostname.empty()) s += " (host " + n.hostname + ", pid " + n.pid + ")";
  return s;
}

void Scheduler::Fail(const std::string& message, std::vector<Outgoing>* out) {
  if (!fatal_.empty()) return;
  fatal_ = message;
  BPS_LOG(kError, message);
  Config failed;
  failed.Set("failed", message);
  TellLauncher(failed, out);
  for (const auto& kv : nodes_) {
    if (!kv.second.departed) out->push_back(Reply(kv.first, MsgType::kError, message));
  }
  for (const auto& kv : waiting_) out->push_back(Reply(kv.first, MsgType::kError, message));
  waiting_.clear();
  waiting_order_.clear();
}

void Scheduler::Handle(const Peer& from, const FrameHeader& h,
                       const std::string& payload, std::vector<Outgoing>* out) {
  MsgType type = static_cast<MsgType>(h.type);
  Config kv = Config::Parse(payload);
  auto it = nodes_.find(from);
  if (it != nodes_.end()) it->second.last_seen = Clock::now();
  if (!fatal_.empty()) {
    // A broken job answers every newcomer with the reason, so nobody waits.
    if (type != MsgType::kBye) out->push_back(Reply(from, MsgType::kError, fatal_));
    return;
  }
  switch (type) {
    case MsgType::kHello:
      OnHello(from, h, kv, out);
      return;
    case MsgType::kControl:
      if (h.sender_role == static_cast<uint16_t>(Role::kLauncher)) OnControl(from, kv, out);
      return;
    case MsgType::kLeave:
      if (it != nodes_.end() && it->second.role == Role::kWorker) OnLeaveRequest(&it->second, out);
      if (it != nodes_.end() && it->second.role == Role::kServer) OnServerLeave(it->second, out);
      return;
    case MsgType::kBarrier:
      if (it == nodes_.end()) return;
      if (epoch_ > 0 && it->second.role == Role::kServer) {
        // A server that joined a running elastic job: the workers meet
        // without it (it started its epoch already, scheduler_servers.cc).
        out->push_back(Reply(from, MsgType::kBarrierDone, ""));
        return;
      }
      barrier_.insert(from);
      // After the first epoch only the workers meet again.
      if (barrier_.size() == static_cast<size_t>(num_workers_ + (epoch_ == 0 ? num_servers_ : 0))) {
        for (const Peer& p : barrier_) out->push_back(Reply(p, MsgType::kBarrierDone, ""));
        barrier_.clear();
      }
      return;
    case MsgType::kEpoch:
      if (it != nodes_.end() && it->second.role == Role::kServer) OnEpochStarted(it->second, kv, out);
      return;
    case MsgType::kDeclare:
      if (it == nodes_.end() || it->second.role != Role::kWorker) return;
      OnDeclare(from, h, kv, out);
      return;
    case MsgType::kPeerLeft:  // elastic: a worker cannot reach a server
      if (it != nodes_.end() && it->second.role == Role::kWorker) OnServerGone(it->second, kv, out);
      return;
    case MsgType::kJoinNotice:
      if (it == nodes_.end() || it->second.role != Role::kWorker) return;
      OnJoin(it->second.id, std::strtoull(kv.Get("seen").c_str(), nullptr, 10), out);
      return;
    case MsgType::kHeartbeat:
      if (it != nodes_.end()) out->push_back(Reply(from, MsgType::kHeartbeatAck, ""));
      if (waiting_.count(from)) {
        waiting_[from].last_seen = Clock::now();
        out->push_back(Reply(from, MsgType::kHeartbeatAck, ""));
      }
      if (joining_servers_.count(from)) {
        joining_servers_[from].last_seen = Clock::now();
        out->push_back(Reply(from, MsgType::kHeartbeatAck, ""));
      }
      if (old_links_.count(from)) {
        heard_from_[old_links_[from]] = Clock::now();
        out->push_back(Reply(from, MsgType::kHeartbeatAck, ""));
      }
      return;
    case MsgType::kBye:
      if (it != nodes_.end()) OnBye(&it->second, kv.Get("reason"), out);
      if (old_links_.count(from) && kv.Get("reason") == kElasticRestart) {
        heard_from_[old_links_[from]] = Clock::now();   // its HELLO follows at once
      }
      if (waiting_.erase(from)) {
        waiting_order_.erase(std::find(waiting_order_.begin(), waiting_order_.end(), from));
      }
      return;
    default:
      return;  // not for the scheduler
  }
}

void Scheduler::OnBye(Node* node, const std::string& reason, std::vector<Outgoing>* out) {
  if (node->departed) return;
  // Elastic: a worker that failed, or that restarts its membership (its
  // program caught a membership change), starts a new epoch; the job goes on.
  if (elastic_ && node->role == Role::kWorker && !reason.empty()) {
    OnElasticBye(node, reason, out);
    return;
  }
  node->departed = true;
  std::string who = Describe(*node);
  if (reason.empty()) {
    BPS_LOG(kInfo, who << " left");
  } else {
    // Logged at once: the reason may explain the errors the others report next.
    BPS_LOG(kWarning, who << " " << reason << " and left the job");
    failure_ += (failure_.empty() ? "" : "; ") + who + " " + reason;
  }
  // Workers still running can no longer complete a push_pull: tell them,
  // so they fail instead of waiting for a partner that is gone. Once each:
  // a worker keeps the first notice, and telling every one of N workers of
  // each of N departures sent N^2 messages when a large job ended, queued
  // ahead of the heartbeats' answers.
  Config left;
  left.Set("who", who);
  left.Set("reason", reason);
  for (auto& n : nodes_) {
    if (n.second.role == Role::kWorker && !n.second.departed && !n.second.told_left) {
      out->push_back(Reply(n.first, MsgType::kPeerLeft, left.Serialize()));
      n.second.told_left = true;
    }
  }
  int gone = 0;
  for (const auto& n : nodes_) {
    if (n.second.role == Role::kWorker && n.second.departed) ++gone;
  }
  if (gone >= num_workers_) FinishJob(out);
}

void Scheduler::OnElasticBye(Node* node, const std::string& reason, std::vector<Outgoing>* out) {
  Peer peer = node->peer;
  if (reason == kElasticLeave) {
    // A worker that was asked to leave goes, at the commit where the others
    // restart: no rollback (it is no longer expected back).
    std::string key = KeyOf(*node);
    removed_.insert(key);
    Config left;
    left.Set("left", key);
    TellLauncher(left, out);
    BPS_LOG(kInfo, Describe(*node) << " left the job");
    if (changing_) {
      nodes_.erase(peer);
      Reform(out);
    } else {
      StartEpoch(Describe(*node) + " left the job", &peer, out, /*agreed=*/true);
    }
    return;
  }
  bool restarts = reason == kElasticRestart;
  std::string why = Describe(*node) + " " + (restarts ? "restarts its membership" : reason);
  // A launcher reports the process's end soon, with the workers it
  // removes because of it (the rest of a blacklisted host): wait for that.
  if (!restarts && launcher_.valid() && !node->launch_id.empty()) {
    verdicts_[KeyOf(*node)] = Clock::now();
  }
  StartEpoch(why, restarts && !changing_ ? nullptr : &peer, out, /*agreed=*/restarts);
}

void Scheduler::FinishJob(std::vector<Outgoing>* out) {
  // Newcomers still waiting to join have nothing left to join: they go.
  for (const auto& w : waiting_) {
    out->push_back(Reply(w.first, MsgType::kLeave, "why=the job finished"));
  }
  waiting_.clear();
  waiting_order_.clear();
  if (elastic_) {
    Config done;
    done.Set("finished", failure_.empty() ? "1" : "0");
    TellLauncher(done, out);
  }
  // The servers exit non-zero with the reasons when a worker did not finish.
  std::string ending = failure_.empty() ? "" : "the job failed: " + failure_;
  for (auto& n : nodes_) {
    if (n.second.role == Role::kServer) {
      out->push_back(Reply(n.first, MsgType::kShutdown, ending));
      n.second.departed = true;
    }
  }
  for (const auto& s : joining_servers_) out->push_back(Reply(s.first, MsgType::kShutdown, ""));
  joining_servers_.clear();
  finished_ = true;
}

void Scheduler::OnHello(const Peer& from, const FrameHeader& h, const Config& kv,
                        std::vector<Outgoing>* out) {
  Node n;
  n.peer = from;
  n.role = static_cast<Role>(h.sender_role);
  n.id = h.sender;
  n.hostname = kv.Get("hostname");
  n.host_key = kv.Get("host_key", n.hostname);
  n.pid = kv.Get("pid");
  n.data_addr = kv.Get("data_addr");
  n.local_addr = kv.Get("local_addr");
  n.machine = kv.Get("machine");
  n.local_rank = KvInt(kv, "local_rank", -1);
  n.local_size = KvInt(kv, "local_size", -1);
  n.launch_id = kv.Get("launch_id");
  n.start_rank = KvInt(kv, "start_rank", -1);
  n.last_seen = Clock::now();
  if (n.role != Role::kWorker && n.role != Role::kServer) return;
  if (kv.Get("recover") == "1") {
    // A node that lost the scheduler says what it was doing.
    OnRecoverHello(from, n, kv, out);
    return;
  }
  if (elastic_ && n.role == Role::kWorker && (!welcomed_ || recovering_) && n.id >= 0 &&
      kv.Get("rejoin") == "1") {
    // A member back from a membership change at a scheduler that never
    // formed one, or that is rebuilding: the scheduler restarted meanwhile
    // (with a server lost at the same time, or while this worker was between
    // two epochs). Its HELLO is its report; it is no newcomer.
    Config report = kv;
    report.Set("recover", "1");
    report.Set("welcomed", "0");
    OnRecoverHello(from, n, report, out);
    return;
  }
  if (elastic_ && n.role == Role::kServer && welcomed_) {
    OnServerHello(from, n, kv, out);
    return;
  }
  if (elastic_ && n.role == Role::kWorker && (welcomed_ || n.id < 0)) {
    OnElasticHello(from, n, kv, out);
    return;
  }
  nodes_[from] = n;

  // Every node must agree with the scheduler on the settings that shape the
  // data: a disagreement names the setting and both values.
  std::string disagree = SettingsDisagree(n, kv);
  if (!disagree.empty()) {
    Fail(disagree, out);
    return;
  }
  if (n.role == Role::kWorker && (n.id < 0 || n.id >= num_workers_)) {
    Fail("worker rank " + std::to_string(n.id) + " is outside [0, " +
             std::to_string(num_workers_) + ") (DMLC_WORKER_ID)",
         out);
    return;
  }
  for (const auto& other : nodes_) {
    if (other.first != from && other.second.role == n.role && n.id >= 0 &&
        other.second.id == n.id) {
      Fail("two " + std::string(RoleName(n.role)) + "s claim id " + std::to_string(n.id) +
               ": " + Describe(other.second) + " and " + Describe(n),
           out);
      return;
    }
  }
  BPS_LOG(kInfo, Describe(n) << " joined");
  MaybeWelcome(out);
}

std::string Scheduler::SettingsDisagree(const Node& n, const Config& kv) const {
  for (const SharedSetting& s : kSharedSettings) {
    if (elastic_ && n.role == Role::kWorker && std::string(s.key) == "num_workers") continue;
    std::string mine = cfg_.Get(s.key, "");
    std::string theirs = kv.Get(s.key, "");
    if (mine != theirs) {
      return std::string("cluster setting '") + s.key + "' disagrees: the scheduler has " + mine +
             ", " + Describe(n) + " has " + theirs + " (" +
             SameEverywhere(s, cfg_, Describe(n), kv) + ")";
    }
  }
  return "";
}

void Scheduler::Tick(std::vector<Outgoing>* out) {
  if (fatal_.empty() && !welcomed_) {
    ReportMissing();
    if (RendezvousExpired(out)) return;
  }
  if (!fatal_.empty() || !welcomed_ || finished_) return;
  if (elastic_) {
    TickElastic(out);  // lost workers start a new epoch there
    if (!fatal_.empty()) return;
  }
  if (elastic_) TickServers(out);  // a lost server starts a new epoch there
  if (!fatal_.empty()) return;
  for (const auto& kv : nodes_) {
    const Node& n = kv.second;
    if (n.departed || elastic_) continue;
    double quiet = SecondsSince(n.last_seen);
    if (quiet > timeout_s_) {
      Fail("lost " + Describe(n) + ": no heartbeat for " + std::to_string(static_cast<int>(quiet)) +
               " s (it died or hung; BYTEPS_TIMEOUT=" + std::to_string(static_cast<int>(timeout_s_)) +
               ")",
           out);
      return;
    }
  }
  if (!changing_) CheckStalls(out);
}

}  // namespace bps
