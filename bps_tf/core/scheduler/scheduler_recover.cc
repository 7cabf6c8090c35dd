// A scheduler that restarts (BYTEPS_ELASTIC=1, docs/elastic.md).
//
// The scheduler holds the membership, the tensor declarations and the key
// placement, but nothing the training cannot rebuild: every worker and
// server knows its own part. When the scheduler's process is lost and
// started again at the same address (by bpslaunch, or by Kubernetes
// restarting its pod), each node notices (its link to the scheduler broke,
// or the scheduler went silent for BYTEPS_TIMEOUT), opens a new link and
// says HELLO again with "recover=1" and what it was doing: its epoch, its
// rank or server id, the size of its membership, whether it was admitted.
//
// The restarted scheduler rebuilds from these reports and starts the next
// membership epoch as after any change: the servers are taken in as they
// are (they keep their ids and addresses); a worker whose engine still
// runs the old epoch is told the workers changed, so it returns to its
// commit and comes back, as a survivor does. The epoch forms once every
// rank and server the reports name is back, or BYTEPS_TIMEOUT after the
// latest report; the declarations and the key placement start afresh
// (every engine declares its tensors again anyway). Processes that start
// while it recovers (a newcomer, a replacement server) join that epoch.
//
// The same HELLO can reach a scheduler that never went away, when only a
// node's link broke: it is then taken as a link that changed (Relinked).
#include <algorithm>

#include "scheduler/scheduler.h"

namespace bps {

void Scheduler::BeginRecovery() {
  recovering_ = true;
  welcomed_ = true;
  changing_ = true;
  servers_starting_ = false;
  servers_started_.clear();
  expected_.clear();
  old_links_.clear();
  heard_from_.clear();
  change_since_ = Clock::now();
  change_why_ = "the scheduler restarted";
  // Processes that said a first HELLO before any report are new: workers
  // wait to join, servers join at the epoch that forms.
  for (auto& kv : nodes_) {
    Node n = kv.second;
    if (n.role == Role::kWorker) {
      n.id = -1;
      n.arrival = next_arrival_++;
      waiting_[kv.first] = n;
      waiting_order_.push_back(kv.first);
    } else {
      n.arrival = next_arrival_++;
      joining_servers_[kv.first] = n;
    }
  }
  nodes_.clear();
  barrier_.clear();
  BPS_LOG(kWarning, "this scheduler was restarted: rebuilding the membership from what the "
                    "workers and servers report");
}

void Scheduler::OnRecoverHello(const Peer& from, const Node& node, const Config& kv,
                               std::vector<Outgoing>* out) {
  Node n = node;
  if (!elastic_) {
    out->push_back(Reply(from, MsgType::kError,
                         "a node re-registers with a restarted scheduler, but this scheduler "
                         "runs a fixed job (BYTEPS_ELASTIC=0): only elastic jobs survive a "
                         "lost scheduler"));
    return;
  }
  std::string disagree = SettingsDisagree(n, kv);
  if (!disagree.empty()) {
    BPS_LOG(kWarning, "refused a node that re-registers: " << disagree);
    out->push_back(Reply(from, MsgType::kError, disagree));
    return;
  }
  if (!welcomed_) BeginRecovery();
  if (!recovering_) return Relinked(from, n, kv, out);
  const bool admitted = kv.Get("welcomed") == "1";
  const int epoch = KvInt(kv, "epoch", 0);
  if (n.role == Role::kServer && admitted && ReportedAgain(from, n, out)) return;
  // The next epoch is above any epoch a node reports (servers drop pushes
  // of another epoch, so it must be new to every one of them).
  if (!servers_starting_ && epoch + 1 > epoch_) epoch_ = epoch + 1;
  change_since_ = Clock::now();  // BYTEPS_TIMEOUT for the others' reports runs from here
  if (n.role == Role::kServer) {
    if (!admitted) return OnServerHello(from, n, kv, out);  // it was joining
    for (const auto& other : nodes_) {
      if (other.second.role == Role::kServer && other.second.id == n.id) {
        out->push_back(Reply(from, MsgType::kError,
                             "server id " + std::to_string(n.id) + " is claimed twice: " +
                                 Describe(other.second) + " reported it already"));
        return;
      }
    }
    nodes_[from] = n;
    // Heard: it sends heartbeats again while the epoch forms (the workers
    // may take longer than BYTEPS_TIMEOUT to return to their commit), and
    // is neither taken for silent nor reports again.
    out->push_back(Reply(from, MsgType::kHeartbeatAck, ""));
    BPS_LOG(kInfo, Describe(n) << " is back (it was in membership epoch " << epoch << ")");
    MaybeFinishEpoch(out);
    return;
  }
  if (n.id < 0) {  // a newcomer that was waiting
    OnElasticHello(from, n, kv, out);
    return;
  }
  // The workers of the last epoch: every rank up to its size is awaited.
  const int size = KvInt(kv, "size", 0);
  for (int r = 0; r < size; ++r) {
    if (recover_ranks_.insert(r).second) expected_.insert(r);
  }
  recover_servers_ = std::max(recover_servers_, KvInt(kv, "servers", 0));
  if (recover_ranks_.insert(n.id).second) expected_.insert(n.id);
  if (admitted) {
    // Its engine still runs the old epoch: it returns to its commit and
    // comes back with a HELLO that names its rank, as a survivor does.
    Config note;
    note.Set("epoch", std::to_string(epoch_));
    note.Set("why", change_why_);
    out->push_back(Reply(from, MsgType::kWorkersChanged, note.Serialize()));
    // Its heartbeats on this link say it is alive while its program reaches
    // the change, as a survivor's do after any change (SurvivorsOnTheirWay).
    old_links_[from] = n.id;
    heard_from_[n.id] = Clock::now();
    BPS_LOG(kInfo, "worker " << n.id << " (host " << n.hostname << ", pid " << n.pid
                             << ") reported membership epoch " << epoch << "; it restarts");
    MaybeFinishEpoch(out);
    return;
  }
  // Restarted already (it was between two epochs): back.
  OnElasticHello(from, n, kv, out);
}

const Scheduler::Node* Scheduler::MoveToLink(const Peer& from, const Node& n) {
  for (auto it = nodes_.begin(); it != nodes_.end(); ++it) {
    const Node& m = it->second;
    if (m.role != n.role || m.id != n.id || m.pid != n.pid || m.hostname != n.hostname ||
        m.departed) {
      continue;
    }
    Node moved = m;
    moved.peer = from;
    moved.last_seen = Clock::now();
    nodes_.erase(it);
    return &(nodes_[from] = moved);
  }
  return nullptr;
}

bool Scheduler::ReportedAgain(const Peer& from, const Node& n, std::vector<Outgoing>* out) {
  // The same server again (our answer was lost, or its link changed):
  // nothing new, so the others' reports are not waited for any longer.
  if (MoveToLink(from, n) == nullptr) return false;
  out->push_back(Reply(from, MsgType::kHeartbeatAck, ""));
  return true;
}

void Scheduler::Relinked(const Peer& from, const Node& node, const Config& kv,
                         std::vector<Outgoing>* out) {
  Node n = node;
  const bool admitted = kv.Get("welcomed") == "1";
  if (const Node* same = MoveToLink(from, n)) {
    // The same process on a new link: only its peer changes.
    const Node moved = *same;
    BPS_LOG(kWarning, Describe(moved) << " re-registered: its link to the scheduler broke");
    if (n.role == Role::kServer) {
      if (servers_starting_ && !servers_started_.count(n.id)) {
        Config start;
        start.Set("epoch", std::to_string(epoch_));
        start.Set("num_workers", std::to_string(num_workers_));
        out->push_back(Reply(from, MsgType::kEpoch, start.Serialize()));
      }
      return;
    }
    // A worker's answers on its old link are lost (declarations, a
    // barrier): its membership starts again, from its commit.
    if (!changing_) {
      StartEpoch(Describe(moved) + " re-registered (its link to the scheduler broke)", nullptr,
                 out);
    }
    return;
  }
  if (n.role == Role::kServer) {
    if (!admitted) return OnServerHello(from, n, kv, out);
    out->push_back(Reply(from, MsgType::kError,
                         "server " + std::to_string(n.id) + " (host " + n.hostname + ", pid " +
                             n.pid + ") is no longer part of this elastic job: the scheduler "
                             "dropped it (it went silent for BYTEPS_TIMEOUT)"));
    return;
  }
  if (admitted && n.id >= 0 && changing_ && expected_.count(n.id)) {
    // Told of the change on the link that broke: told again here.
    Config note;
    note.Set("epoch", std::to_string(epoch_));
    note.Set("why", change_why_);
    out->push_back(Reply(from, MsgType::kWorkersChanged, note.Serialize()));
    return;
  }
  Config hello = kv;
  if (admitted) hello.Set("rejoin", "1");  // a member the scheduler dropped is refused there
  OnElasticHello(from, n, hello, out);
}

}  // namespace bps
