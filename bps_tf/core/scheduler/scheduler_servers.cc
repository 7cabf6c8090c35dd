// Elastic servers (BYTEPS_ELASTIC=1, docs/elastic.md).
//
// In synchronous training a server holds nothing between rounds but
// half-summed rounds, which every epoch change drops anyway. So a server
// that is lost (no heartbeat for BYTEPS_TIMEOUT, or the launcher saw its
// process end) is a membership change like a lost worker: the workers roll
// back to their commit, and the epoch that follows places every key again
// on the servers that remain, balanced by bytes. A server that joins (a
// replacement the launcher or Kubernetes started) and a server that leaves
// on SIGTERM are announced to the workers instead: they restart at their
// next commit without a rollback, and the servers change at that epoch.
//
// Servers keep their ids: "server 1" stays "server 1" in every message,
// and a replacement takes the id of the one it replaces (a Kubernetes pod
// keeps its TF_CONFIG index, bpslaunch gives it the same id). Ids are
// therefore sparse while a server is missing; the workers never see them:
// a worker reaches the servers by their place in ServersInOrder() (by id),
// which its WELCOME lists and the key placement uses, and which only
// changes at an epoch, when every worker's engine starts afresh.
#include <algorithm>
#include <vector>

#include "scheduler/scheduler.h"

namespace bps {

namespace {
// The flags of a host update (Horovod's HostUpdateResult), as for workers.
constexpr int kServerLeaves = 1;  // removed: the others need no sync
constexpr int kServerAdded = 2;
}  // namespace

int Scheduler::ServerCount() const {
  int n = 0;
  for (const auto& kv : nodes_) n += kv.second.role == Role::kServer && !kv.second.departed;
  return n;
}

std::vector<const Scheduler::Node*> Scheduler::ServersInOrder() const {
  std::vector<const Node*> servers;
  for (const auto& kv : nodes_) {
    if (kv.second.role == Role::kServer && !kv.second.departed) servers.push_back(&kv.second);
  }
  std::sort(servers.begin(), servers.end(),
            [](const Node* a, const Node* b) { return a->id < b->id; });
  return servers;
}

void Scheduler::AnnounceServers(int flags, std::vector<Outgoing>* out) {
  // A host update, as for workers that join or leave (scheduler_control.cc):
  // the members raise HostsUpdatedInterrupt at their next commit and
  // restart their membership together, keeping the state; nothing is
  // rolled back, and the servers change at the epoch that follows.
  if (changing_) return;  // the epoch that forms takes them in
  NotifyHosts(flags, out);
}

bool Scheduler::LostServer(const std::string& id, const std::string& why,
                           std::vector<Outgoing>* out) {
  for (auto it = joining_servers_.begin(); it != joining_servers_.end(); ++it) {
    if (KeyOf(it->second) == id) {
      joining_servers_.erase(it);
      return true;
    }
  }
  for (const auto& kv : nodes_) {
    if (kv.second.role != Role::kServer || kv.second.departed || KeyOf(kv.second) != id) continue;
    Peer lost = kv.first;
    // Known at once, not after BYTEPS_TIMEOUT: the launcher saw it end.
    LoseServer(lost, "lost " + Describe(kv.second) + ": " + why, out);
    return true;
  }
  return false;
}

void Scheduler::OnServerHello(const Peer& from, const Node& node, const Config& kv,
                              std::vector<Outgoing>* out) {
  Node n = node;
  n.arrival = next_arrival_++;
  // A server with other settings is refused alone; the job goes on.
  std::string disagree = SettingsDisagree(n, kv);
  if (!disagree.empty()) {
    BPS_LOG(kWarning, "refused a server that wants to join: " << disagree);
    out->push_back(Reply(from, MsgType::kError, disagree));
    return;
  }
  for (auto it = nodes_.begin(); it != nodes_.end(); ++it) {
    const Node& s = it->second;
    if (s.role != Role::kServer || s.departed || n.id < 0 || s.id != n.id) continue;
    if (s.pid == n.pid && s.hostname == n.hostname) return;  // the same process again
    // A new process claims a live server's id: a pod restarted by
    // Kubernetes, or a replacement, before the old one was noticed gone.
    Peer old = it->first;
    LoseServer(old, "server " + std::to_string(n.id) + " was replaced: a new process (host " +
                        n.hostname + ", pid " + n.pid + ") took its id",
               out);
    break;
  }
  for (const auto& kv : joining_servers_) {
    if (n.id >= 0 && kv.second.id == n.id && kv.first != from) {
      std::string why = "server id " + std::to_string(n.id) + " is claimed twice: " +
                        Describe(kv.second) + " waits to join already";
      BPS_LOG(kWarning, "refused a server that wants to join: " << why);
      out->push_back(Reply(from, MsgType::kError, why));
      return;
    }
  }
  joining_servers_[from] = n;
  BPS_LOG(kWarning, "a server (host " << n.hostname << ", pid " << n.pid
                                      << ") joins the job at the next membership epoch");
  if (changing_) {
    MaybeFinishEpoch(out);
  } else {
    AnnounceServers(kServerAdded, out);
  }
}

void Scheduler::LoseServer(const Peer& peer, const std::string& why, std::vector<Outgoing>* out) {
  auto it = nodes_.find(peer);
  if (it == nodes_.end() || it->second.role != Role::kServer) return;
  // A server that was only unreachable stops instead of serving nobody
  // (bpslaunch or Kubernetes starts it again; it then joins afresh).
  out->push_back(Reply(peer, MsgType::kError, "this server was dropped from the elastic job: " + why));
  leaving_servers_.erase(it->second.id);
  nodes_.erase(it);
  placement_stale_ = true;
  if (ServerCount() == 0) no_server_since_ = Clock::now();
  // Every worker comes back (none is lost): rounds that server held are
  // gone, so every worker returns to its commit.
  StartEpoch(why, nullptr, out);
}

void Scheduler::OnServerGone(const Node& worker, const Config& kv, std::vector<Outgoing>* out) {
  // A notice of an earlier epoch may name a server whose id a replacement
  // took since: only the current epoch's count.
  if (!elastic_ || KvInt(kv, "epoch", -1) != epoch_) return;
  const int id = KvInt(kv, "server", -1);
  for (const auto& n : nodes_) {
    if (n.second.role != Role::kServer || n.second.id != id || n.second.departed) continue;
    Peer lost = n.first;
    LoseServer(lost, "lost " + Describe(n.second) + ": " + Describe(worker) +
                         " cannot reach it (" + kv.Get("why") + ")",
               out);
    return;
  }
}

void Scheduler::OnServerLeave(const Node& server, std::vector<Outgoing>* out) {
  if (!elastic_ || server.departed || leaving_servers_.count(server.id)) return;
  leaving_servers_.insert(server.id);
  BPS_LOG(kWarning, Describe(server) << " leaves the job at the next commit (SIGTERM)");
  AnnounceServers(kServerLeaves, out);
  if (changing_) MaybeFinishEpoch(out);
}

void Scheduler::TickServers(std::vector<Outgoing>* out) {
  for (auto it = joining_servers_.begin(); it != joining_servers_.end();) {
    if (SecondsSince(it->second.last_seen) > timeout_s_) {
      BPS_LOG(kWarning, "a server waiting to join (host " << it->second.hostname << ", pid "
                                                          << it->second.pid << ") went silent");
      it = joining_servers_.erase(it);
    } else {
      ++it;
    }
  }
  for (const auto& kv : nodes_) {
    const Node& n = kv.second;
    if (n.departed || n.role != Role::kServer) continue;
    double quiet = SecondsSince(n.last_seen);
    if (quiet > timeout_s_) {
      Peer lost = kv.first;
      LoseServer(lost, "lost " + Describe(n) + ": no heartbeat for " +
                           std::to_string(static_cast<int>(quiet)) + " s (BYTEPS_TIMEOUT=" +
                           std::to_string(static_cast<int>(timeout_s_)) + ")",
                 out);
      return;  // the iterator is gone
    }
  }
  if (changing_) MaybeFinishEpoch(out);  // waiting for a server, or a restarted scheduler's reports
}

bool Scheduler::ReadyToForm(std::vector<Outgoing>* out) {
  bool quiet = SecondsSince(change_since_) > timeout_s_;
  if (recovering_ && !quiet) {
    // A restarted scheduler waits for the reports of the last epoch's
    // workers and servers (BYTEPS_TIMEOUT after the latest one).
    if (recover_ranks_.empty() || ServerCount() < recover_servers_) return false;
  }
  if (ServerCount() + static_cast<int>(joining_servers_.size()) > 0) return true;
  // No server left: the keys have nowhere to go until one joins (the
  // launcher, or Kubernetes, starts a replacement).
  if (no_server_since_ == Clock::time_point{}) no_server_since_ = Clock::now();
  if (SecondsSince(no_server_since_) > elastic_timeout_s_) {
    Fail("elastic job: no server is left (" + change_why_ + ") and none joined within " +
             std::to_string(static_cast<int>(elastic_timeout_s_)) +
             " s (--elastic-timeout / BYTEPS_ELASTIC_TIMEOUT)",
         out);
  }
  return false;
}

void Scheduler::SettleServers(std::vector<Outgoing>* out) {
  recovering_ = false;
  no_server_since_ = Clock::time_point{};
  // Servers that asked to leave go now (every worker has restarted: none
  // pushes to them any more), unless no other server would be left.
  for (auto it = nodes_.begin(); it != nodes_.end();) {
    const Node& s = it->second;
    bool others = ServerCount() - 1 + static_cast<int>(joining_servers_.size()) > 0;
    if (s.role != Role::kServer || !leaving_servers_.count(s.id) || !others) {
      ++it;
      continue;
    }
    BPS_LOG(kWarning, Describe(s) << " left the job; its keys move to the other servers");
    out->push_back(Reply(it->first, MsgType::kShutdown, ""));
    leaving_servers_.erase(s.id);
    it = nodes_.erase(it);
    placement_stale_ = true;
  }
  // Joining servers take their id (a free one if they named none or a
  // taken one), get their WELCOME, then the epoch like every server.
  std::set<int> taken;
  for (const Node* s : ServersInOrder()) taken.insert(s->id);
  std::vector<std::pair<Peer, Node>> joining(joining_servers_.begin(), joining_servers_.end());
  joining_servers_.clear();
  std::sort(joining.begin(), joining.end(),
            [](const std::pair<Peer, Node>& a, const std::pair<Peer, Node>& b) {
              return a.second.arrival < b.second.arrival;
            });
  for (auto& j : joining) {
    Node& s = j.second;
    if (s.id < 0 || taken.count(s.id)) {
      s.id = 0;
      while (taken.count(s.id)) ++s.id;
    }
    taken.insert(s.id);
    s.last_seen = Clock::now();
    nodes_[j.first] = s;
    placement_stale_ = true;
    BPS_LOG(kWarning, Describe(s) << " joins at membership epoch " << epoch_);
  }
  num_servers_ = ServerCount();
  const std::vector<const Node*> servers = ServersInOrder();
  for (auto& j : joining) {
    out->push_back(Reply(j.first, MsgType::kWelcome,
                         WelcomeOf(nodes_.at(j.first), HostLayout(), servers).Serialize()));
  }
  if (placement_stale_) PlaceAgain();
}

void Scheduler::PlaceAgain() {
  placement_stale_ = false;
  server_load_.assign(static_cast<size_t>(std::max(num_servers_, 1)), 0);
  // Largest first, so the greedy placement balances the bytes best; the
  // key breaks ties, so the placement does not depend on the map's order.
  std::vector<Assignment*> all;
  for (auto& kv : assigned_) all.push_back(&kv.second);
  std::sort(all.begin(), all.end(), [](const Assignment* a, const Assignment* b) {
    return a->bytes != b->bytes ? a->bytes > b->bytes : a->key < b->key;
  });
  for (Assignment* a : all) a->servers = Place(a->dtype, a->bytes);
  BPS_LOG(kInfo, "placed " << all.size() << " tensors again on " << num_servers_ << " server(s)");
}

}  // namespace bps
