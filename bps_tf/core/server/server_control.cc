// A server node's link to the scheduler: the scheduler's messages (the
// WELCOME, a new membership epoch, the end of the job, an error), the
// checks of a scheduler this node hosts, a scheduler that went silent or
// refused the link (elastic: re-registering with a restarted one,
// scheduler_recover.cc), and leaving the job at the workers' next commit.
#include <algorithm>
#include <string>
#include <vector>

#include "common/stats.h"
#include "server/server_node_impl.h"

namespace bps {

void ServerNode::OnWelcome(const Config& layout) {
  SetLogIdentity(Who());
  Stats::Get().node_state = 1;  // the cluster met (read by the health service)
  if (!is_server_) return;
  // A server that joins a running elastic job serves its current workers.
  num_workers_ = static_cast<int>(layout.GetInt("num_workers", num_workers_));
  engine_.reset(new SumEngine(membership_.id(), num_workers_,
                              static_cast<int>(cfg_.GetInt("engine_threads", 4)),
                              [this](std::vector<ServerReply>&& r) { replies_.Post(std::move(r)); }));
}

void ServerNode::StartEpoch(const Config& kv) {
  int epoch = static_cast<int>(kv.GetInt("epoch", 0));
  int workers = static_cast<int>(kv.GetInt("num_workers", 0));
  if (!is_server_ || !engine_ || workers < 1 || epoch <= epoch_ || epoch > 0xffff) return;
  // The old engine's threads stop first; what they posted is dropped with
  // what waits for credit: no sum of the old epoch reaches anyone.
  engine_.reset();
  replies_.Take();
  schedule_.DropQueued();
  worker_peer_.clear();
  num_workers_ = workers;
  epoch_ = static_cast<uint16_t>(epoch);
  engine_.reset(new SumEngine(membership_.id(), num_workers_,
                              static_cast<int>(cfg_.GetInt("engine_threads", 4)),
                              [this](std::vector<ServerReply>&& r) { replies_.Post(std::move(r)); }));
  BPS_LOG(kInfo, "membership epoch " << epoch_ << ": " << num_workers_ << " workers");
  membership_.Send(MsgType::kEpoch, "epoch=" + std::to_string(epoch_));
}

void ServerNode::HandleControl(const Message& m) {
  if (membership_.Handle(m, [this](const Config& layout) { OnWelcome(layout); })) return;
  switch (static_cast<MsgType>(m.header.type)) {
    case MsgType::kEpoch:
      StartEpoch(Config::Parse(m.payload.str()));
      break;
    case MsgType::kShutdown:
      // A job that a worker left with a reason (interrupted, failed) ends
      // with that reason and a non-zero exit: it did not succeed.
      if (m.payload.size() != 0) {
        Stop(m.payload.str());
        break;
      }
      Stats::Get().node_state = 2;
      done_ = true;
      break;
    case MsgType::kError:
      if (!scheduler_) Stop(m.payload.str());  // else our own scheduler decides when we stop
      break;
    default:
      break;
  }
}

void ServerNode::TickScheduler(std::vector<Outgoing>* out, Clock::time_point* fatal_since) {
  scheduler_->Tick(out);
  SendOutgoing(out);
  if (scheduler_->finished() && !is_server_ && !done_) Stop(scheduler_->failure());
  if (!is_server_ && scheduler_->welcomed() && Stats::Get().node_state == 0) {
    Stats::Get().node_state = 1;  // a scheduler-only node: the cluster met
  }
  if (!scheduler_->fatal().empty()) {
    Stats::Get().node_state = 3;
    // Stay a little to tell late joiners why the job failed.
    if (*fatal_since == Clock::time_point{}) *fatal_since = Clock::now();
    if (SecondsSince(*fatal_since) > 3) Stop(scheduler_->fatal());
  }
}

void ServerNode::WatchScheduler(const std::string& scheduler_at, Clock::time_point started) {
  membership_.Tick();
  if (elastic_ && is_server_ && !hosts_scheduler_ && RelinkIfLost(scheduler_at)) return;
  if (membership_.joined() && membership_.welcomed() && membership_.Silent(timeout_s_)) {
    Stop(Who() + " lost contact with the scheduler at " + scheduler_at + " for " +
         std::to_string(static_cast<int>(timeout_s_)) + " s (BYTEPS_TIMEOUT)");
  }
  std::string refusal = channel_->Refusal();  // of its one link, to the scheduler
  if (!refusal.empty()) {
    Stop(Who() + (membership_.welcomed() ? ": " : " could not meet the cluster: ") + refusal);
  } else if (!membership_.welcomed() && !hosts_scheduler_ &&
             SecondsSince(started) > JoinTimeout()) {
    Stop(Who() + " " + membership_.RendezvousFailure(JoinTimeout()));
  }
}

void ServerNode::AskToLeave() {
  leave_asked_ = true;
  if (!membership_.welcomed()) {
    Stop("");  // not serving yet: nothing to hand over
    return;
  }
  // The scheduler tells this server to shut down (exit 0) at the epoch in
  // which the workers no longer use it.
  BPS_LOG(kWarning, Who() << " got SIGTERM: it leaves the job at the workers' next commit "
                             "(a second SIGTERM ends it at once)");
  membership_.Send(MsgType::kLeave, "");
}

double ServerNode::JoinTimeout() const {
  // A server joining a running elastic job waits for the workers' next
  // commit, as a newcomer worker does.
  return elastic_ ? std::max(rendezvous_timeout_s_, cfg_.GetDouble("elastic_timeout_s", 600))
                  : rendezvous_timeout_s_;
}

bool ServerNode::RelinkIfLost(const std::string& scheduler_at) {
  if (!membership_.joined()) return false;
  bool lost = membership_.Dropped() ||
              ((membership_.welcomed() || membership_.relinking()) &&
               membership_.Silent(timeout_s_));
  if (!lost) return false;
  if (membership_.relinking() && SecondsSince(membership_.relink_started()) > recovery_s_) {
    Stop(Who() + " lost contact with the scheduler at " + scheduler_at +
         ", and it did not come back within " + std::to_string(static_cast<int>(recovery_s_)) +
         " s (BYTEPS_SCHEDULER_RECOVERY_TIMEOUT)");
    return true;
  }
  // This server keeps summing the rounds of its epoch meanwhile; a
  // restarted scheduler takes it in as it is (scheduler_recover.cc).
  Config report;
  report.Set("recover", "1");
  report.Set("epoch", std::to_string(epoch_));
  report.Set("welcomed", membership_.welcomed() ? "1" : "0");
  BPS_LOG(kWarning, (membership_.relinking() ? "still no answer from" : "lost")
                        << " the scheduler at " << scheduler_at
                        << "; re-registering (it may be restarting; up to "
                        << static_cast<int>(recovery_s_)
                        << " s, BYTEPS_SCHEDULER_RECOVERY_TIMEOUT)");
  membership_.Relink(report);
  return true;
}

}  // namespace bps
