// A node's membership of the job, the client side of the scheduler: HELLO
// with the settings every node must share, WELCOME with the layout, the
// start-up barrier, heartbeats, and noticing a scheduler gone silent.
// Workers and servers differ only in what they add to HELLO, what they do on
// WELCOME, and how long they wait before calling the scheduler lost.
#ifndef BPS_TF_CORE_SCHEDULER_MEMBERSHIP_H_
#define BPS_TF_CORE_SCHEDULER_MEMBERSHIP_H_

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
  // Sends a heartbeat when one is due.
  void Tick();
  // True once nothing came from the scheduler for longer than timeout_s.
  bool Silent(double timeout_s) const { return SecondsSince(last_heard_) > timeout_s; }
  // Says goodbye and gives it linger_ms to reach the scheduler.
  void Leave(int linger_ms);
  void Close();

 private:
  Channel* channel_;
  Role role_;
  int id_;
  double heartbeat_s_;
  Peer scheduler_;
  bool welcomed_ = false;
  bool ready_ = false;
  Clock::time_point last_heard_ = Clock::now();
  Clock::time_point last_beat_ = Clock::now();
};

}  // namespace bps

#endif  // BPS_TF_CORE_SCHEDULER_MEMBERSHIP_H_
