// Elastic membership with a launcher, and workers that leave on purpose
// (docs/elastic.md).
//
// bpslaunch sees its processes end at once, long before a heartbeat goes
// missing: it reports each one ("lost=", with the workers it removes
// because of it, e.g. the rest of a blacklisted host), so the survivors
// roll back within a round trip instead of BYTEPS_TIMEOUT. It also names the
// newcomers it starts ("announce="): the members hear of them at once (a
// host update, "added"), raise HostsUpdatedInterrupt at their next commit,
// and the epoch that follows waits for them. A worker removed from the job
// (its host left the discovery script's list or was blacklisted, or it got
// SIGTERM and asked to leave) is told so; the others hear "removed", and at
// the next commit everyone restarts together while it leaves: no rollback.
//
// The launcher's link is authenticated like any other (the job token);
// every launcher message names processes by their launch id
// (BYTEPS_LAUNCH_ID), which each worker gives in its HELLO.
#include <algorithm>
#include <chrono>
#include <vector>

#include "scheduler/scheduler.h"

namespace bps {

namespace {
constexpr int kRemovedFlag = 1;  // Horovod's HostUpdateResult.removed
constexpr int kAddedFlag = 2;    // ... .added

std::vector<std::string> SplitIds(const std::string& list) {
  std::vector<std::string> ids;
  size_t pos = 0;
  while (pos <= list.size()) {
    size_t comma = list.find(',', pos);
    if (comma == std::string::npos) comma = list.size();
    if (comma > pos) ids.push_back(list.substr(pos, comma - pos));
    pos = comma + 1;
  }
  return ids;
}
}  // namespace

std::string Scheduler::KeyOf(const Node& n) {
  return n.launch_id.empty() ? n.hostname + "/" + n.pid : n.launch_id;
}

std::string Scheduler::Members() const {
  std::vector<const Node*> workers;
  for (const auto& kv : nodes_) {
    if (kv.second.role == Role::kWorker && !kv.second.departed) workers.push_back(&kv.second);
  }
  std::sort(workers.begin(), workers.end(),
            [](const Node* a, const Node* b) { return a->id < b->id; });
  std::string ids;
  for (const Node* w : workers) ids += (ids.empty() ? "" : ",") + KeyOf(*w);
  return ids;
}

void Scheduler::TellLauncher(const Config& kv, std::vector<Outgoing>* out) {
  if (launcher_.valid()) out->push_back(Reply(launcher_, MsgType::kControl, kv.Serialize()));
}

void Scheduler::NotifyHosts(int flags, std::vector<Outgoing>* out) {
  // Horovod's workers compare update times; ours also rise within a second.
  int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  update_ms_ = std::max(now_ms, update_ms_ + 1);
  ++update_seq_;
  Config note;
  note.Set("seq", std::to_string(update_seq_));
  note.Set("time_ms", std::to_string(update_ms_));
  note.Set("flags", std::to_string(flags));
  note.Set("waiting", std::to_string(waiting_.size() + announced_.size()));
  for (const auto& kv : nodes_) {
    if (kv.second.role == Role::kWorker && !kv.second.departed) {
      out->push_back(Reply(kv.first, MsgType::kHostsUpdated, note.Serialize()));
    }
  }
}

void Scheduler::Reform(std::vector<Outgoing>* out) {
  if (servers_starting_) {
    // The servers were told a worker count that no longer holds.
    ++epoch_;
    servers_starting_ = false;
    servers_started_.clear();
  }
  MaybeFinishEpoch(out);
}

bool Scheduler::Remove(const std::string& id, const std::string& why, std::vector<Outgoing>* out) {
  removed_.insert(id);
  Config leave;
  leave.Set("why", why);
  for (auto it = nodes_.begin(); it != nodes_.end(); ++it) {
    Node& n = it->second;
    if (n.role != Role::kWorker || n.departed || KeyOf(n) != id) continue;
    if (!changing_) {
      // A member: it leaves at the next commit, with everyone restarting there.
      if (n.leaving) return false;
      n.leaving = true;
      BPS_LOG(kWarning, Describe(n) << " leaves the job at the next commit: " << why);
      out->push_back(Reply(it->first, MsgType::kLeave, leave.Serialize()));
      Config told;
      told.Set("leaving", id);
      TellLauncher(told, out);
      return true;
    }
    // Back already for the epoch that forms: it is not part of it.
    BPS_LOG(kWarning, Describe(n) << " is removed from the membership that forms: " << why);
    out->push_back(Reply(it->first, MsgType::kLeave, leave.Serialize()));
    nodes_.erase(it);
    Reform(out);
    return false;
  }
  for (auto it = expected_ids_.begin(); it != expected_ids_.end(); ++it) {
    if (it->second != id) continue;
    BPS_LOG(kWarning, "worker " << it->first << " (" << id << ") is not waited for: " << why);
    expected_.erase(it->first);
    expected_ids_.erase(it);
    return false;
  }
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    if (KeyOf(it->second) != id) continue;
    out->push_back(Reply(it->first, MsgType::kLeave, leave.Serialize()));
    waiting_order_.erase(std::find(waiting_order_.begin(), waiting_order_.end(), it->first));
    waiting_.erase(it);
    return false;
  }
  announced_.erase(id);
  awaited_.erase(id);
  return false;
}

void Scheduler::Lost(const std::string& id, const std::string& why, std::vector<Outgoing>* out) {
  if (LostServer(id, why, out)) return;  // scheduler_servers.cc
  verdicts_.erase(id);
  announced_.erase(id);
  awaited_.erase(id);
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    if (KeyOf(it->second) != id) continue;
    waiting_order_.erase(std::find(waiting_order_.begin(), waiting_order_.end(), it->first));
    waiting_.erase(it);
    return;
  }
  for (auto it = expected_ids_.begin(); it != expected_ids_.end(); ++it) {
    if (it->second != id) continue;
    expected_.erase(it->first);
    expected_ids_.erase(it);
    return;
  }
  for (auto& kv : nodes_) {
    Node& n = kv.second;
    if (n.role != Role::kWorker || n.departed || KeyOf(n) != id) continue;
    Peer peer = kv.first;
    // Known at once, not after BYTEPS_TIMEOUT: the launcher saw it end.
    StartEpoch("lost " + Describe(n) + ": " + why, &peer, out);
    return;
  }
}

void Scheduler::OnControl(const Peer& from, const Config& kv, std::vector<Outgoing>* out) {
  if (!elastic_) return;
  if (kv.Has("hello")) {
    launcher_ = from;
    Config state;
    state.Set("epoch", std::to_string(epoch_));
    state.Set("members", welcomed_ && !changing_ ? Members() : "");
    TellLauncher(state, out);
  }
  // The workers a failure removes come with it, so the epoch it starts
  // never forms with them (Horovod blacklists a failed worker's host before
  // its next rendezvous).
  bool leaving = false;
  std::string why = kv.Get("why", "removed by the launcher");
  for (const std::string& id : SplitIds(kv.Get("remove"))) leaving = Remove(id, why, out) || leaving;
  if (leaving) NotifyHosts(kRemovedFlag, out);
  for (const std::string& id : SplitIds(kv.Get("lost"))) {
    Lost(id, kv.Get("lost_why", "its process ended"), out);
  }
  bool announced = false;
  for (const std::string& id : SplitIds(kv.Get("announce"))) {
    // A quick newcomer may have said HELLO before its announcement came.
    bool here = removed_.count(id) != 0;
    for (const auto& w : waiting_) here = here || KeyOf(w.second) == id;
    for (const auto& n : nodes_) here = here || KeyOf(n.second) == id;
    if (here) continue;
    announced_[id] = Clock::now();
    announced = true;
  }
  // The members hear of newcomers at once (not when those have started);
  // during a change they hear when the new membership starts.
  if (announced && welcomed_ && !changing_) TellWaiting(out);
  if (changing_) MaybeFinishEpoch(out);
}

void Scheduler::OnLeaveRequest(Node* node, std::vector<Outgoing>* out) {
  if (!elastic_ || node->departed || node->leaving) return;
  // SIGTERM (a pod's eviction, or bpslaunch removing a host): the worker
  // leaves at the next commit, and the others go on without a rollback.
  bool leaving = Remove(KeyOf(*node), "it asked to leave (SIGTERM)", out);
  if (leaving) NotifyHosts(kRemovedFlag, out);
}

void Scheduler::TellWaiting(std::vector<Outgoing>* out) {
  int room = max_workers_ - WorkerCount();
  int coming = static_cast<int>(waiting_.size() + announced_.size());
  if (std::min(coming, std::max(room, 0)) > 0) NotifyHosts(kAddedFlag, out);
}

}  // namespace bps
