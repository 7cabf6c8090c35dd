// The server node's class, shared by its two files: server_node.cc runs
// the data path (listening, pushes, the summed replies, the close) and
// server_control.cc the link to the scheduler (its messages, the hosted
// scheduler's checks, a lost scheduler, leaving at a commit). Included by
// those two alone; the rest of bps_tf starts a node with RunServerNode
// (server_node.h).
#ifndef BPS_TF_CORE_SERVER_SERVER_NODE_IMPL_H_
#define BPS_TF_CORE_SERVER_SERVER_NODE_IMPL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/common.h"
#include "scheduler/membership.h"
#include "scheduler/scheduler.h"
#include "server/reply_scheduler.h"
#include "server/server_parts.h"
#include "server/sum_engine.h"
#include "transport/channel.h"

namespace bps {

class ServerNode {
 public:
  explicit ServerNode(const Config& cfg);

  int Run(std::string* error);

 private:
  // Run's steps: listen, host the scheduler if asked and say HELLO (returns
  // the listening link; *scheduler_at names the scheduler for messages);
  // the hosted scheduler's periodic checks; the scheduler's silence, a
  // refused link or a rendezvous that takes too long; the last replies and
  // the close.
  Peer Start(std::string* scheduler_at);
  void TickScheduler(std::vector<Outgoing>* out, Clock::time_point* fatal_since);
  void WatchScheduler(const std::string& scheduler_at, Clock::time_point started);
  // Elastic: re-registers with a scheduler that was lost (restarted at the
  // same address; scheduler_recover.cc); true when it did or gave up.
  bool RelinkIfLost(const std::string& scheduler_at);
  double JoinTimeout() const;
  void AskToLeave();
  int Finish(const Peer& listener, std::string* error);
  void Handle(Message& m);
  void HandlePush(Message& m);
  // The scheduler's messages to this node (server_control.cc).
  void HandleControl(const Message& m);
  void OnWelcome(const Config& layout);
  // Elastic: a new membership epoch (scheduler_elastic.cc): every round of
  // the old one is dropped, unanswered, and the worker count changes.
  void StartEpoch(const Config& kv);
  void SendOutgoing(std::vector<Outgoing>* out);
  void SendReplies(bool ignore_credit = false);
  void SendReply(int worker, const FrameHeader& header, Msg&& payload, uint64_t reserved,
                 SharedSealSlot* shared = nullptr);
  void SubmitFused(Message& m);
  void Stop(const std::string& error);
  std::string Who() const {
    if (!is_server_) return "scheduler";
    // Before the WELCOME a server without BYTEPS_SERVER_ID has no id yet.
    return membership_.id() >= 0 ? "server " + std::to_string(membership_.id()) : "server";
  }

  Config cfg_;
  bool is_server_;
  bool hosts_scheduler_;
  int num_workers_;
  uint16_t epoch_ = 0;  // pushes of another epoch are dropped
  uint64_t fusion_bytes_;  // largest fused reply; 0: none
  double timeout_s_;
  double rendezvous_timeout_s_;
  bool elastic_;
  double recovery_s_;  // BYTEPS_SCHEDULER_RECOVERY_TIMEOUT
  server_parts::ReplyQueue replies_;  // before channel_: the channel waits on its Wakeup
  // Before channel_ too: libzmq hands the replies' credit back to it until
  // the channel is gone.
  ReplyScheduler schedule_;
  std::unique_ptr<Channel> channel_;
  Membership membership_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<SumEngine> engine_;
  std::unordered_map<int, Peer> worker_peer_;
  bool done_ = false;
  bool leave_asked_ = false;  // elastic: a SIGTERM asked to leave (docs/elastic.md)
  int exit_code_ = 0;
  std::string error_;
};

}  // namespace bps

#endif  // BPS_TF_CORE_SERVER_SERVER_NODE_IMPL_H_
