// A node's membership of the job, the client side of the scheduler: HELLO
// with the settings every node must share, WELCOME with the layout, the
// start-up barrier, heartbeats, and noticing a scheduler gone silent.
// Workers and servers differ only in what they add to HELLO, what they do on
// WELCOME, and how long they wait before calling the scheduler lost.
#ifndef BPS_TF_CORE_SCHEDULER_MEMBERSHIP_H_
#define BPS_TF_CORE_SCHEDULER_MEMBERSHIP_H_

#include <atomic>
#include <functional>
#include <string>

#include "common/common.h"
#include "transport/channel.h"

namespace bps {

class Membership {
 public:
  using OnWelcome = std::function<void(const Config& layout)>;
  Membership(Channel* channel, Role role, int id, double heartbeat_s)
      : channel_(channel), role_(role), id_(id), heartbeat_s_(heartbeat_s) {}

  // Connects to the scheduler and says HELLO: this node's shared settings
  // (from cfg), host and pid, and `extra`.
  void Join(const std::string& endpoint, const Config& cfg, const Config& extra);
  bool joined() const { return scheduler_.valid(); }
  bool FromScheduler(const Message& m) const { return joined() && m.from == scheduler_; }

  // Takes the membership part of a message from the scheduler; true if it
  // was that. On WELCOME it adopts the id the scheduler gave, runs
  // on_welcome, then enters the barrier.
  bool Handle(const Message& m, const OnWelcome& on_welcome);
  bool welcomed() const { return welcomed_; }
  bool ready() const { return ready_; }  // the barrier is passed
  int id() const { return id_; }

  void Send(MsgType type, const std::string& payload, uint64_t request_id = 0,
            uint16_t dtype = 0);
  // Sends a heartbeat when one is due; until the WELCOME, also logs every
  // kWaitReportS (a third of a shorter BYTEPS_RENDEZVOUS_TIMEOUT) what this
  // node waits for (WaitingLine).
  void Tick();
  // What this node waits for after `waited_s` without a WELCOME: the
  // scheduler's first answer, or the other nodes; names the scheduler and
  // where its address came from (Join's cfg: scheduler_origin).
  std::string WaitingLine(double waited_s) const;
  // Why the meeting did not happen within BYTEPS_RENDEZVOUS_TIMEOUT =
  // `timeout_s`, worded in the terms of the user's configuration (TF_CONFIG
  // users are not sent to DMLC_* variables): "could not meet the cluster
  // at the scheduler ... within N s: ...".
  std::string RendezvousFailure(double timeout_s) const;
  static constexpr double kWaitReportS = 10;
  // Waiting lines are warnings from this fraction of the timeout on, INFO before.
  static constexpr double kWarnAfter = 0.5;
  // True once nothing came from the scheduler for longer than timeout_s.
  bool Silent(double timeout_s) const { return SecondsSince(last_heard_) > timeout_s; }
  // Elastic (docs/elastic.md): whether the link to the scheduler broke (its
  // process ended, or the network dropped it).
  bool Dropped() const { return joined() && channel_->Dropped(scheduler_); }
  // Re-registers with a scheduler that was lost, restarted at the same
  // address: a new link (a sealed link's keys were the old process's), and
  // Join's HELLO again with `report` (recover=1, what this node was doing).
  // A node that gets no answer calls it again; relinking() holds until the
  // scheduler answers, and relink_started() is when the first call came.
  void Relink(const Config& report);
  bool relinking() const { return relinking_; }
  Clock::time_point relink_started() const { return relink_started_; }
  // Says goodbye, with why this node leaves ("" when it finished), and gives
  // it linger_ms to reach the scheduler.
  void Leave(int linger_ms, const std::string& reason = "");
  // An elastic worker that has no rank yet: it waits to be admitted.
  bool newcomer() const { return role_ == Role::kWorker && id_ < 0; }
  void Close();

 private:
  Channel* channel_;
  Role role_;
  int id_;
  double heartbeat_s_;
  Peer scheduler_;
  std::string endpoint_;
  // Where the scheduler's address and the cluster's size came from, in the
  // user's terms (bps_tf/runtime/cluster.py): "TF_CONFIG's ps task 0", ...
  std::string origin_, members_origin_;
  double rendezvous_s_ = 0;
  double report_every_s_ = kWaitReportS;
  Clock::time_point joined_at_ = Clock::now();
  Clock::time_point last_report_ = Clock::now();
  std::atomic<bool> heard_{false};  // anything came from the scheduler
  bool report_waiting_ = true;
  bool rejoining_ = false;  // elastic: a member joining the next membership epoch
  bool welcomed_ = false;
  bool ready_ = false;
  Clock::time_point last_heard_ = Clock::now();
  Clock::time_point last_beat_ = Clock::now();
  Config hello_;  // Join's HELLO, said again by Relink
  bool relinking_ = false;
  Clock::time_point relink_started_{};
};

}  // namespace bps

#endif  // BPS_TF_CORE_SCHEDULER_MEMBERSHIP_H_
