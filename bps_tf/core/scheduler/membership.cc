#include "scheduler/membership.h"

#include <unistd.h>

#include <algorithm>

namespace bps {

namespace {
// The pid keeps a restarted node's routing id apart from its old one. A
// count keeps a membership restarted by the same process (elastic), or a
// link opened again (Relink), apart from its old link, which the scheduler
// may not have closed yet.
std::string LinkName(Role role, int id) {
  static std::atomic<int> joins{0};
  return std::string("ctl-") + RoleName(role) + "-" + std::to_string(id) + "-" +
         std::to_string(getpid()) + "-" + std::to_string(joins++);
}
}  // namespace

void Membership::Join(const std::string& endpoint, const Config& cfg, const Config& extra) {
  scheduler_ = channel_->Connect(endpoint, LinkName(role_, id_));
  endpoint_ = endpoint;
  origin_ = cfg.Get("scheduler_origin", "DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT");
  members_origin_ = cfg.Get("members_origin", "DMLC_NUM_WORKER/DMLC_NUM_SERVER");
  rendezvous_s_ = cfg.GetDouble("rendezvous_timeout_s", 120);
  report_every_s_ = std::min(kWaitReportS, std::max(1.0, rendezvous_s_ / 3));
  joined_at_ = last_report_ = Clock::now();
  heard_ = false;
  // A node that hosts the scheduler meets itself: the scheduler reports who
  // is missing instead.
  report_waiting_ = cfg.GetInt("host_scheduler", 0) == 0;
  rejoining_ = cfg.GetInt("elastic_rejoin", 0) != 0;
  Config hello = extra;
  for (const SharedSetting& s : kSharedSettings) hello.Set(s.key, cfg.Get(s.key));
  hello.Set("hostname", cfg.Get("hostname"));
  // The scheduler's errors about the cluster's size name it, in this node's terms.
  hello.Set("members_origin", members_origin_);
  hello.Set("pid", std::to_string(getpid()));
  welcomed_ = ready_ = false;
  relinking_ = false;
  last_heard_ = last_beat_ = Clock::now();
  hello_ = hello;
  Send(MsgType::kHello, hello.Serialize());
}

void Membership::Relink(const Config& report) {
  if (!relinking_) relink_started_ = Clock::now();
  relinking_ = true;
  if (scheduler_.valid()) channel_->Close(scheduler_, 0);
  scheduler_ = channel_->Connect(endpoint_, LinkName(role_, id_));
  heard_ = false;
  last_heard_ = last_beat_ = Clock::now();
  Config hello = hello_;
  for (const auto& kv : report.values()) hello.Set(kv.first, kv.second);
  // libzmq holds the HELLO until the scheduler listens again.
  Send(MsgType::kHello, hello.Serialize());
}

bool Membership::Handle(const Message& m, const OnWelcome& on_welcome) {
  last_heard_ = Clock::now();
  heard_ = true;
  if (relinking_) {
    relinking_ = false;
    BPS_LOG(kWarning, "the scheduler at " << endpoint_ << " answered again after "
                                          << static_cast<int>(SecondsSince(relink_started_))
                                          << " s");
  }
  switch (static_cast<MsgType>(m.header.type)) {
    case MsgType::kWelcome: {
      Config layout = Config::Parse(m.payload.str());
      id_ = static_cast<int>(layout.GetInt("id", id_));
      welcomed_ = true;
      on_welcome(layout);
      Send(MsgType::kBarrier, "");
      return true;
    }
    case MsgType::kBarrierDone:
      ready_ = true;
      return true;
    case MsgType::kHeartbeatAck:
      return true;
    default:
      return false;
  }
}

void Membership::Send(MsgType type, const std::string& payload, uint64_t request_id,
                      uint16_t dtype) {
  if (!joined()) return;
  FrameHeader h = MakeHeader(type, role_, id_);
  h.request_id = request_id;
  h.dtype = dtype;
  channel_->Send(scheduler_, h, payload);
}

void Membership::Tick() {
  if (!joined()) return;
  if (!welcomed_ && report_waiting_ && SecondsSince(last_report_) >= report_every_s_) {
    last_report_ = Clock::now();
    // Nodes start seconds apart (a TensorFlow import takes 10 s on a busy
    // machine): waiting is news only once half of the timeout has passed.
    double waited = SecondsSince(joined_at_);
    if (waited >= rendezvous_s_ * kWarnAfter) {
      BPS_LOG(kWarning, WaitingLine(waited));
    } else {
      BPS_LOG(kInfo, WaitingLine(waited));
    }
  }
  if (SecondsSince(last_beat_) < heartbeat_s_) return;
  last_beat_ = Clock::now();
  if (relinking_) return;  // nothing queues behind the HELLO for a scheduler that is not back
  Send(MsgType::kHeartbeat, "");
}

std::string Membership::WaitingLine(double waited_s) const {
  std::string waited = std::to_string(static_cast<int>(waited_s)) + " s";
  std::string limit = " (BYTEPS_RENDEZVOUS_TIMEOUT=" +
                      std::to_string(static_cast<int>(rendezvous_s_)) + " s)";
  if (!heard_) {
    return "waiting for the scheduler at " + endpoint_ + " (from " + origin_ + ") for " + waited +
           ": no answer yet; is that process started, and can this machine reach that "
           "address?" + limit;
  }
  if (rejoining_) {
    return "the scheduler at " + endpoint_ + " answered; waiting for the next membership to "
           "form (the other members to come back, the newcomers announced to start), for " +
           waited + limit;
  }
  if (newcomer()) {
    return "the scheduler at " + endpoint_ + " answered; this new worker waits to be admitted "
           "into the running job at its next membership change (elastic), for " + waited + limit;
  }
  return "the scheduler at " + endpoint_ + " answered; waiting for the other workers and "
         "servers of " + members_origin_ + " to join, for " + waited + limit;
}

std::string Membership::RendezvousFailure(double timeout_s) const {
  std::string head = "could not meet the cluster at the scheduler " + endpoint_ + " within " +
                     std::to_string(static_cast<int>(timeout_s)) +
                     " s (BYTEPS_RENDEZVOUS_TIMEOUT): ";
  if (!heard_) {
    return head + "it never answered; check " + origin_ + " (the scheduler's address), that "
           "the process there runs and that this machine can reach it, and that "
           "BYTEPS_JOB_TOKEN and BYTEPS_ENCRYPTION are the same on every node";
  }
  if (newcomer()) {
    return head + "it answered, but did not admit this new worker: the job is at its largest "
           "size (BYTEPS_ELASTIC_MAX_WORKERS), or its first workers never met (check that every "
           "node of " + members_origin_ + " was started)";
  }
  return head + "it answered, but not every worker and server joined; check that every "
         "node of " + members_origin_ + " was started (the scheduler logs which are missing)";
}

void Membership::Leave(int linger_ms, const std::string& reason) {
  if (!joined()) return;
  Config bye;
  if (!reason.empty()) bye.Set("reason", reason);
  Send(MsgType::kBye, bye.Serialize());
  channel_->Close(scheduler_, linger_ms);
  scheduler_ = Peer();
}

void Membership::Close() {
  if (!joined()) return;
  channel_->Close(scheduler_, 0);
  scheduler_ = Peer();
}

}  // namespace bps
