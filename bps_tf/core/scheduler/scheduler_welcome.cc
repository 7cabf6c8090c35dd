// The cluster's first meeting: once every node said HELLO, the servers get
// their ids, the workers are grouped by host (local, cross and host ranks)
// and each node gets its WELCOME; until then, who is missing is reported
// and a meeting that takes too long fails the job.
#include <algorithm>
#include <random>
#include <sstream>

#include "scheduler/membership.h"
#include "scheduler/scheduler.h"

namespace bps {

void Scheduler::MaybeWelcome(std::vector<Outgoing>* out) {
  int workers = 0, servers = 0;
  for (const auto& n : nodes_) (n.second.role == Role::kWorker ? workers : servers)++;
  if (workers > num_workers_ || servers > num_servers_) {
    Fail("more nodes joined than the cluster has: " + std::to_string(workers) + " workers (of " +
             std::to_string(num_workers_) + ") and " + std::to_string(servers) + " servers (of " +
             std::to_string(num_servers_) + "), as " +
             cfg_.Get("members_origin", "DMLC_NUM_WORKER/DMLC_NUM_SERVER") + " says",
         out);
    return;
  }
  if (welcomed_ || workers != num_workers_ || servers != num_servers_) return;
  welcomed_ = true;
  std::vector<const Node*> servers_by_id;
  if (!NumberServers(&servers_by_id, out)) return;
  const HostLayout hosts = LayOutHosts();
  for (auto& kv : nodes_) {
    out->push_back(Reply(kv.first, MsgType::kWelcome,
                         WelcomeOf(kv.second, hosts, servers_by_id).Serialize()));
  }
  BPS_LOG(kInfo, "all " << num_workers_ << " workers and " << num_servers_ << " servers met");
  if (elastic_) {
    Config formed;
    formed.Set("epoch", std::to_string(epoch_));
    formed.Set("members", Members());
    TellLauncher(formed, out);
  }
}

bool Scheduler::NumberServers(std::vector<const Node*>* servers_by_id,
                              std::vector<Outgoing>* out) {
  // Servers without an id take the free ones in the order they joined.
  std::vector<Node*> server_nodes;
  std::set<int> taken;
  for (auto& n : nodes_) {
    if (n.second.role == Role::kServer) {
      server_nodes.push_back(&n.second);
      if (n.second.id >= 0) taken.insert(n.second.id);
    }
  }
  int next = 0;
  for (Node* s : server_nodes) {
    if (s->id >= 0) continue;
    while (taken.count(next)) ++next;
    s->id = next;
    taken.insert(next);
  }
  servers_by_id->assign(static_cast<size_t>(num_servers_), nullptr);
  for (Node* s : server_nodes) {
    if (s->id >= num_servers_) {
      Fail("server id " + std::to_string(s->id) + " is outside [0, " +
               std::to_string(num_servers_) + ") (BYTEPS_SERVER_ID)",
           out);
      return false;
    }
    (*servers_by_id)[static_cast<size_t>(s->id)] = s;
  }
  return true;
}

Scheduler::HostLayout Scheduler::LayOutHosts() {
  HostLayout hosts;
  host_roots_.clear();
  // Local rank: workers on one host, in rank order, unless a launcher said.
  for (auto& n : nodes_) {
    if (n.second.role == Role::kWorker) hosts.by_host[n.second.host_key].push_back(&n.second);
  }
  // Names the job's local-reduce rendezvous, so two jobs on one host never meet.
  std::random_device rd;
  hosts.job_nonce = std::to_string((static_cast<uint64_t>(rd()) << 32) ^ rd());
  int host_index = 0;
  for (auto& host : hosts.by_host) {
    std::sort(host.second.begin(), host.second.end(),
              [](const Node* a, const Node* b) { return a->id < b->id; });
    for (size_t i = 0; i < host.second.size(); ++i) {
      Node* w = host.second[i];
      if (w->local_rank < 0) w->local_rank = static_cast<int>(i);
      if (w->local_size < 0) w->local_size = static_cast<int>(host.second.size());
    }
    std::string ranks;
    for (const Node* w : host.second) ranks += (ranks.empty() ? "" : ",") + std::to_string(w->id);
    host_roots_.insert(host.second.front()->id);
    for (const Node* w : host.second) {
      hosts.host_ranks[w->id] = ranks;
      hosts.host_index[w->id] = host_index;
    }
    ++host_index;
  }

  // Horovod's cross rank and size: the hosts that hold a worker of this
  // worker's local rank, in host order, and this worker's host among them.
  for (auto& kv : nodes_) {
    if (kv.second.role != Role::kWorker) continue;
    hosts.hosts_of_local_rank[std::max(kv.second.local_rank, 0)].push_back(
        hosts.host_index[kv.second.id]);
  }
  for (auto& kv : hosts.hosts_of_local_rank) std::sort(kv.second.begin(), kv.second.end());
  for (auto& host : hosts.by_host) {
    hosts.homogeneous =
        hosts.homogeneous && host.second.size() == hosts.by_host.begin()->second.size();
  }
  return hosts;
}

std::string Scheduler::Missing() const {
  std::set<int> workers;
  int servers = 0;
  for (const auto& n : nodes_) {
    if (n.second.role == Role::kWorker) workers.insert(n.second.id);
    if (n.second.role == Role::kServer) ++servers;
  }
  std::string missing;
  for (int r = 0; r < num_workers_; ++r) {
    if (!workers.count(r)) missing += (missing.empty() ? "worker(s) " : ", ") + std::to_string(r);
  }
  if (servers < num_servers_) {
    missing += (missing.empty() ? "" : "; ") + std::to_string(num_servers_ - servers) + " of " +
               std::to_string(num_servers_) + " servers";
  }
  return missing + " (" + std::to_string(nodes_.size()) + " of " +
         std::to_string(num_workers_ + num_servers_) + " nodes joined)";
}

void Scheduler::ReportMissing() {
  if (SecondsSince(last_report_) < report_every_s_) return;
  last_report_ = Clock::now();
  std::ostringstream line;
  line << "waiting for the cluster to meet, for " << static_cast<int>(SecondsSince(started_))
       << " s: not joined yet: " << Missing();
  // Nodes start seconds apart: news only once half of the timeout has passed.
  if (SecondsSince(started_) >= rendezvous_s_ * Membership::kWarnAfter) {
    BPS_LOG(kWarning, line.str());
  } else {
    BPS_LOG(kInfo, line.str());
  }
}

bool Scheduler::RendezvousExpired(std::vector<Outgoing>* out) {
  // Each node gives up after BYTEPS_RENDEZVOUS_TIMEOUT on its own clock and
  // names its own cause; the scheduler waits a fifth longer (and 2 s), so it
  // speaks only when no node is left to: a scheduler nobody reaches would
  // otherwise wait forever.
  if (rendezvous_s_ <= 0 || SecondsSince(started_) < rendezvous_s_ * 1.2 + 2) return false;
  Fail("the cluster did not meet within " + std::to_string(static_cast<int>(rendezvous_s_)) +
           " s (BYTEPS_RENDEZVOUS_TIMEOUT): not joined yet: " + Missing() +
           "; check that every worker and server was started with this scheduler's address",
       out);
  return true;
}

Config Scheduler::WelcomeOf(const Node& n, const HostLayout& hosts,
                            const std::vector<const Node*>& servers_by_id) const {
  Config w;
  w.Set("id", std::to_string(n.id));
  w.Set("num_workers", std::to_string(num_workers_));
  w.Set("num_servers", std::to_string(num_servers_));
  w.Set("local_rank", std::to_string(std::max(n.local_rank, 0)));
  w.Set("local_size", std::to_string(std::max(n.local_size, 1)));
  w.Set("epoch", std::to_string(epoch_));
  if (n.role == Role::kWorker) {
    w.Set("num_hosts", std::to_string(hosts.by_host.size()));
    w.Set("host_index", std::to_string(hosts.host_index.at(n.id)));
    w.Set("host_ranks", hosts.host_ranks.at(n.id));
    const std::vector<int>& peers = hosts.hosts_of_local_rank.at(std::max(n.local_rank, 0));
    int host = hosts.host_index.at(n.id);
    w.Set("cross_size", std::to_string(peers.size()));
    w.Set("cross_rank", std::to_string(
        std::lower_bound(peers.begin(), peers.end(), host) - peers.begin()));
    w.Set("homogeneous", hosts.homogeneous ? "1" : "0");
    w.Set("job_nonce", hosts.job_nonce);
  }
  for (size_t i = 0; i < servers_by_id.size(); ++i) {
    const Node* s = servers_by_id[i];
    std::string key = "server." + std::to_string(i);
    w.Set(key, s ? s->data_addr : "");
    if (s) w.Set(key + ".id", std::to_string(s->id));  // sparse in elastic jobs
    if (s && !s->local_addr.empty()) {
      w.Set(key + ".local", s->local_addr);
      w.Set(key + ".machine", s->machine);
    }
  }
  return w;
}

}  // namespace bps
