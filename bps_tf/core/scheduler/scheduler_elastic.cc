// Membership epochs (BYTEPS_ELASTIC=1, docs/elastic.md).
//
// A lost or failed worker does not end an elastic job. The scheduler starts
// a new epoch: it tells every surviving worker (whose pending and later
// operations then fail with a membership-change error) and forgets them
// until each says HELLO again, as a new engine. When the survivors are back
// (or BYTEPS_TIMEOUT passed for the ones that are not), newcomers waiting
// to join are admitted up to the maximum, ranks are given densely (the
// survivors in the order of their old ranks, then the newcomers in the
// order they came), the servers drop every round of the old epoch and take
// the new worker count, and only once every server has confirmed do the
// workers get their WELCOME: no push of the new epoch can meet a server
// still in the old one, and a server drops any push of another epoch.
#include <algorithm>
#include <vector>

#include "scheduler/scheduler.h"

namespace bps {

int Scheduler::WorkerCount() const {
  int n = 0;
  for (const auto& kv : nodes_) n += kv.second.role == Role::kWorker ? 1 : 0;
  return n;
}

void Scheduler::OnElasticHello(const Peer& from, const Node& node, const Config& kv,
                               std::vector<Outgoing>* out) {
  Node n = node;
  n.arrival = next_arrival_++;
  if (removed_.count(KeyOf(n))) {
    // Removed from the job (its host left, or it asked to leave): it goes.
    BPS_LOG(kInfo, "worker " << KeyOf(n) << " was removed from the job; told to leave");
    out->push_back(Reply(from, MsgType::kLeave, "why=it was removed from the elastic job"));
    return;
  }
  // Only a member restarting its membership keeps a rank; a process that
  // starts while the job runs (a replacement pod with its TF_CONFIG index,
  // a worker bpslaunch adds) is a newcomer whatever rank it names.
  if (kv.Get("rejoin") != "1") n.id = -1;
  // A newcomer with other settings is refused alone; the job goes on.
  std::string disagree = SettingsDisagree(n, kv);
  if (!disagree.empty()) {
    BPS_LOG(kWarning, "refused a worker that wants to join: " << disagree);
    out->push_back(Reply(from, MsgType::kError, disagree));
    return;
  }
  if (n.id >= 0 && !changing_) {
    // A member that restarts its membership before its goodbye arrived (two
    // sockets of one process keep no order between them).
    for (const auto& other : nodes_) {
      if (other.second.role == Role::kWorker && other.second.id == n.id &&
          other.second.pid == n.pid && other.second.hostname == n.hostname && !other.second.departed) {
        StartEpoch(Describe(other.second) + " restarts its membership", nullptr, out,
                   /*agreed=*/true);
        break;
      }
    }
  }
  if (n.id >= 0 && changing_ && expected_.count(n.id)) {
    expected_.erase(n.id);
    nodes_[from] = n;
    BPS_LOG(kInfo, "worker " << n.id << " (host " << n.hostname << ", pid " << n.pid
                             << ") is back for membership epoch " << epoch_);
    MaybeFinishEpoch(out);
    return;
  }
  if (n.id >= 0) {
    std::string why = "worker " + std::to_string(n.id) + " (host " + n.hostname + ", pid " +
                      n.pid + ") is no longer a member of this elastic job: the scheduler "
                      "dropped it (it went silent for BYTEPS_TIMEOUT=" +
                      std::to_string(static_cast<int>(timeout_s_)) +
                      " s, or did not come back in time after a membership change)";
    BPS_LOG(kWarning, why);
    out->push_back(Reply(from, MsgType::kError, why));
    return;
  }
  waiting_[from] = n;
  waiting_order_.push_back(from);
  // A newcomer the launcher announced: the members heard of it already.
  bool announced = announced_.erase(KeyOf(n)) != 0;
  awaited_.erase(KeyOf(n));
  BPS_LOG(kInfo, "a new worker (host " << n.hostname << ", pid " << n.pid
                                       << ") waits to join at the next membership epoch");
  if (changing_) {
    MaybeFinishEpoch(out);
  } else if (welcomed_ && !announced) {
    TellWaiting(out);
  }
}

void Scheduler::StartEpoch(const std::string& why, const Peer* lost, std::vector<Outgoing>* out,
                           bool agreed) {
  if (changing_) {
    // A worker lost while the epoch forms: forget it; if the servers were
    // already told a worker count, form the epoch again under a new number.
    if (lost) nodes_.erase(*lost);
    BPS_LOG(kWarning, why << " while membership epoch " << epoch_ << " forms");
    if (servers_starting_) {
      ++epoch_;
      servers_starting_ = false;
      servers_started_.clear();
    }
    MaybeFinishEpoch(out);
    return;
  }
  if (reset_limit_ >= 0 && resets_ >= reset_limit_) {
    Fail("elastic job stopped: the number of resets exceeded the limit of " +
             std::to_string(reset_limit_) + " (--reset-limit / BYTEPS_ELASTIC_RESET_LIMIT): " +
             "reset " + std::to_string(resets_ + 1) + " was due (" + why + ")",
         out);
    return;
  }
  ++resets_;
  ++epoch_;
  changing_ = true;
  servers_starting_ = false;
  servers_started_.clear();
  change_since_ = Clock::now();
  change_why_ = why;
  expected_.clear();
  expected_ids_.clear();
  old_links_.clear();
  heard_from_.clear();
  // Newcomers the members were told of: this epoch waits for them.
  awaited_.clear();
  for (const auto& a : announced_) awaited_.insert(a.first);
  Config note;
  note.Set("epoch", std::to_string(epoch_));
  note.Set("why", why);
  for (auto it = nodes_.begin(); it != nodes_.end();) {
    if (it->second.role != Role::kWorker) {
      ++it;
      continue;
    }
    if (!it->second.departed && !(lost && it->first == *lost)) {
      // After an agreed change the others are past the commit's agreement
      // and restart by themselves; failing their operations now would only
      // race with its last replies (some would roll back, some not). A
      // worker that leaves is told all the same: it comes back to no epoch,
      // and the servers drop its replies still queued when the new one
      // starts, so an operation it still waits for would never end. Rolled
      // back or not, it then leaves (exit 0) and its state goes with it.
      if (!agreed || it->second.leaving) {
        out->push_back(Reply(it->first, MsgType::kWorkersChanged, note.Serialize()));
      }
      // A worker asked to leave does not come back.
      if (!it->second.leaving) {
        expected_.insert(it->second.id);
        expected_ids_[it->second.id] = KeyOf(it->second);
        old_links_[it->first] = it->second.id;
        heard_from_[it->second.id] = Clock::now();
      }
    }
    it = nodes_.erase(it);
  }
  // Nothing of the old epoch's declarations, barrier or join holds.
  pending_.clear();
  pending_since_.clear();
  stall_reported_.clear();
  set_conflicts_.clear();
  joined_.clear();
  join_order_.clear();
  barrier_.clear();
  BPS_LOG(kWarning, "membership epoch " << epoch_ << ": " << why << "; waiting for "
                                        << expected_.size() << " worker(s) to come back"
                                        << (waiting_.empty() ? "" : " and admitting newcomers"));
  MaybeFinishEpoch(out);
}

void Scheduler::MaybeFinishEpoch(std::vector<Outgoing>* out) {
  if (!changing_ || servers_starting_ || !fatal_.empty()) return;
  if (!ReadyToForm(out)) return;  // scheduler_servers.cc
  int back = WorkerCount();
  if (SurvivorsOnTheirWay()) return;
  // A failure the launcher has not reported yet: its report names the
  // workers removed with it (the rest of a blacklisted host), which must
  // not be part of this epoch.
  for (const auto& v : verdicts_) {
    if (SecondsSince(v.second) < std::min(timeout_s_, kVerdictWaitS)) return;
  }
  verdicts_.clear();
  if (!awaited_.empty()) {
    if (SecondsSince(change_since_) < newcomer_wait_s_) return;
    BPS_LOG(kWarning, "membership epoch " << epoch_ << ": " << awaited_.size()
                                          << " announced newcomer(s) did not arrive within "
                                          << static_cast<int>(newcomer_wait_s_)
                                          << " s (BYTEPS_RENDEZVOUS_TIMEOUT); going on without them");
    awaited_.clear();
  }
  if (back == 0) {
    // Only the workers hold the trained state: newcomers alone would start
    // over from their programs' initial state, silently.
    Fail("elastic job: no worker of membership epoch " + std::to_string(epoch_ - 1) +
             " is left (" + change_why_ + "); the state they trained is gone with them, so the "
             "job fails instead of starting over (restart it from a checkpoint)",
         out);
    return;
  }
  int newcomers = std::min(static_cast<int>(waiting_.size()), std::max(max_workers_ - back, 0));
  if (back + newcomers < min_workers_) {
    if (SecondsSince(change_since_) > elastic_timeout_s_) {
      Fail("elastic job: only " + std::to_string(back + newcomers) + " worker(s) left after " +
               change_why_ + ", fewer than the minimum of " + std::to_string(min_workers_) +
               " (--min-np / BYTEPS_ELASTIC_MIN_WORKERS), and none came within " +
               std::to_string(static_cast<int>(elastic_timeout_s_)) +
               " s (--elastic-timeout / BYTEPS_ELASTIC_TIMEOUT)",
           out);
    }
    return;
  }
  if (!expected_.empty()) {
    std::string missing;
    for (int r : expected_) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    BPS_LOG(kWarning, "membership epoch " << epoch_ << ": worker(s) " << missing
                                          << " did not come back (silent for BYTEPS_TIMEOUT, or not back within half of "
                                             "BYTEPS_RENDEZVOUS_TIMEOUT); going on without them");
    expected_.clear();
  }
  expected_ids_.clear();
  old_links_.clear();
  heard_from_.clear();
  AdmitNewcomers(newcomers);
  RankWorkers();
  SettleServers(out);  // scheduler_servers.cc: servers that leave or join, keys placed again
  servers_starting_ = true;
  servers_started_.clear();
  Config start;
  start.Set("epoch", std::to_string(epoch_));
  start.Set("num_workers", std::to_string(num_workers_));
  for (const auto& kv : nodes_) {
    if (kv.second.role == Role::kServer) {
      out->push_back(Reply(kv.first, MsgType::kEpoch, start.Serialize()));
    }
  }
}

void Scheduler::AdmitNewcomers(int newcomers) {
  // Newcomers in the order the launcher planned their ranks (its hosts in
  // order, as Horovod's), then in the order they came.
  std::stable_sort(waiting_order_.begin(), waiting_order_.end(), [this](const Peer& a, const Peer& b) {
    const Node& x = waiting_.at(a);
    const Node& y = waiting_.at(b);
    if ((x.start_rank < 0) != (y.start_rank < 0)) return y.start_rank < 0;
    return x.start_rank != y.start_rank ? x.start_rank < y.start_rank : x.arrival < y.arrival;
  });
  for (int i = 0; i < newcomers; ++i) {
    Peer p = waiting_order_.front();
    waiting_order_.erase(waiting_order_.begin());
    nodes_[p] = waiting_[p];
    waiting_.erase(p);
  }
}

void Scheduler::RankWorkers() {
  // Dense ranks: survivors by old rank, then newcomers by their planned
  // rank (the launcher's host order), then by arrival.
  std::vector<Node*> workers;
  for (auto& kv : nodes_) {
    if (kv.second.role == Role::kWorker) workers.push_back(&kv.second);
  }
  std::sort(workers.begin(), workers.end(), [](const Node* a, const Node* b) {
    bool an = a->id < 0, bn = b->id < 0;
    if (an != bn) return bn;
    if (!an) return a->id < b->id;
    if ((a->start_rank < 0) != (b->start_rank < 0)) return b->start_rank < 0;
    return a->start_rank != b->start_rank ? a->start_rank < b->start_rank
                                          : a->arrival < b->arrival;
  });
  for (size_t i = 0; i < workers.size(); ++i) {
    workers[i]->id = static_cast<int>(i);
    workers[i]->local_rank = -1;  // laid out again
    workers[i]->local_size = -1;
  }
  num_workers_ = static_cast<int>(workers.size());
}

bool Scheduler::SurvivorsOnTheirWay() const {
  if (expected_.empty()) return false;
  // A survivor restarts when its program reaches the change (the end of a
  // step, a commit): on a loaded machine that takes longer than BYTEPS_TIMEOUT
  // although its heartbeats say it is alive. Only silence drops it early.
  double limit = rendezvous_s_ > 0 ? rendezvous_s_ / 2 : elastic_timeout_s_;
  if (SecondsSince(change_since_) > limit) return false;
  for (int id : expected_) {
    auto heard = heard_from_.find(id);   // none after a scheduler restart: since the change
    if (SecondsSince(heard == heard_from_.end() ? change_since_ : heard->second) <= timeout_s_) {
      return true;
    }
  }
  return false;
}

void Scheduler::OnEpochStarted(const Node& server, const Config& kv, std::vector<Outgoing>* out) {
  if (!servers_starting_ || KvInt(kv, "epoch", -1) != epoch_) return;
  servers_started_.insert(server.id);
  if (static_cast<int>(servers_started_.size()) == num_servers_) WelcomeWorkers(out);
}

void Scheduler::WelcomeWorkers(std::vector<Outgoing>* out) {
  const std::vector<const Node*> servers = ServersInOrder();
  const HostLayout hosts = LayOutHosts();
  for (auto& kv : nodes_) {
    if (kv.second.role != Role::kWorker) continue;
    kv.second.last_seen = Clock::now();
    out->push_back(Reply(kv.first, MsgType::kWelcome,
                         WelcomeOf(kv.second, hosts, servers).Serialize()));
  }
  changing_ = false;
  servers_starting_ = false;
  BPS_LOG(kWarning, "membership epoch " << epoch_ << " starts with " << num_workers_
                                        << " worker(s) (" << change_why_ << ")");
  Config formed;
  formed.Set("epoch", std::to_string(epoch_));
  formed.Set("members", Members());
  TellLauncher(formed, out);
  TellWaiting(out);
}

void Scheduler::TickElastic(std::vector<Outgoing>* out) {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (SecondsSince(it->second.last_seen) > timeout_s_) {
      BPS_LOG(kWarning, "a worker waiting to join (host " << it->second.hostname << ", pid "
                                                          << it->second.pid << ") went silent");
      waiting_order_.erase(std::find(waiting_order_.begin(), waiting_order_.end(), it->first));
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
  for (const auto& kv : nodes_) {
    const Node& n = kv.second;
    if (n.departed || n.role != Role::kWorker) continue;
    double quiet = SecondsSince(n.last_seen);
    if (quiet > timeout_s_) {
      Peer lost = kv.first;
      StartEpoch("lost " + Describe(n) + ": no heartbeat for " +
                     std::to_string(static_cast<int>(quiet)) + " s (BYTEPS_TIMEOUT=" +
                     std::to_string(static_cast<int>(timeout_s_)) + ")",
                 &lost, out);
      return;  // the iterator is gone
    }
  }
  MaybeFinishEpoch(out);
}

}  // namespace bps
