#include "scheduler/scheduler.h"

#include <algorithm>
#include <cstdlib>
#include <random>

namespace bps {

namespace {
int KvInt(const Config& kv, const std::string& key, int dflt) {
  try {
    return static_cast<int>(kv.GetInt(key, dflt));
  } catch (const Error&) {
    return dflt;
  }
}
}  // namespace

Scheduler::Scheduler(const Config& cfg)
    : cfg_(cfg),
      num_workers_(static_cast<int>(cfg.GetInt("num_workers", 1))),
      num_servers_(static_cast<int>(cfg.GetInt("num_servers", 1))),
      partition_bytes_(cfg.GetInt("partition_bytes", kDefaultPartitionBytes)),
      timeout_s_(cfg.GetDouble("timeout_s", 30)),
      stall_check_s_(cfg.GetDouble("stall_check_s", 60)),
      stall_shutdown_s_(cfg.GetDouble("stall_shutdown_s", 600)),
      server_load_(static_cast<size_t>(std::max(num_servers_, 1)), 0) {}

Outgoing Scheduler::Reply(const Peer& to, MsgType type, const std::string& payload,
                          uint64_t request_id) {
  Outgoing o;
  o.to = to;
  o.header = MakeHeader(type, Role::kScheduler, -1);
  o.header.request_id = request_id;
  o.payload = payload;
  return o;
}

std::string Scheduler::Describe(const Node& n) const {
  std::string s = std::string(RoleName(n.role)) + " " + std::to_string(n.id);
  if (!n.hostname.empty()) s += " (host " + n.hostname + ", pid " + n.pid + ")";
  return s;
}

void Scheduler::Fail(const std::string& message, std::vector<Outgoing>* out) {
  if (!fatal_.empty()) return;
  fatal_ = message;
  BPS_LOG(kError, message);
  for (const auto& kv : nodes_) {
    if (!kv.second.departed) out->push_back(Reply(kv.first, MsgType::kError, message));
  }
}

void Scheduler::Handle(const Peer& from, const FrameHeader& h,
                       const std::string& payload, std::vector<Outgoing>* out) {
  MsgType type = static_cast<MsgType>(h.type);
  Config kv = Config::Parse(payload);
  auto it = nodes_.find(from);
  if (it != nodes_.end()) it->second.last_seen = Clock::now();
  if (!fatal_.empty()) {
    // A broken job answers every newcomer with the reason, so nobody waits.
    if (type != MsgType::kBye) out->push_back(Reply(from, MsgType::kError, fatal_));
    return;
  }
  switch (type) {
    case MsgType::kHello:
      OnHello(from, h, kv, out);
      return;
    case MsgType::kBarrier:
      if (it == nodes_.end()) return;
      barrier_.insert(from);
      if (barrier_.size() == static_cast<size_t>(num_workers_ + num_servers_)) {
        for (const auto& n : nodes_) out->push_back(Reply(n.first, MsgType::kBarrierDone, ""));
        barrier_.clear();
      }
      return;
    case MsgType::kDeclare:
      if (it == nodes_.end() || it->second.role != Role::kWorker) return;
      OnDeclare(from, h, kv, out);
      return;
    case MsgType::kJoinNotice:
      if (it == nodes_.end() || it->second.role != Role::kWorker) return;
      OnJoin(it->second.id, std::strtoull(kv.Get("seen").c_str(), nullptr, 10), out);
      return;
    case MsgType::kHeartbeat:
      if (it != nodes_.end()) out->push_back(Reply(from, MsgType::kHeartbeatAck, ""));
      return;
    case MsgType::kBye: {
      if (it == nodes_.end()) return;
      it->second.departed = true;
      BPS_LOG(kInfo, Describe(it->second) << " left");
      // Workers still running can no longer complete a push_pull: tell them,
      // so they fail instead of waiting for a partner that is gone.
      for (const auto& n : nodes_) {
        if (n.second.role == Role::kWorker && !n.second.departed) {
          out->push_back(Reply(n.first, MsgType::kPeerLeft, Describe(it->second)));
        }
      }
      int left = 0;
      for (const auto& n : nodes_) {
        if (n.second.role == Role::kWorker && n.second.departed) ++left;
      }
      if (left == num_workers_) {
        for (auto& n : nodes_) {
          if (n.second.role == Role::kServer) {
            out->push_back(Reply(n.first, MsgType::kShutdown, ""));
            n.second.departed = true;
          }
        }
        finished_ = true;
      }
      return;
    }
    default:
      return;  // not for the scheduler
  }
}

void Scheduler::OnHello(const Peer& from, const FrameHeader& h, const Config& kv,
                        std::vector<Outgoing>* out) {
  Node n;
  n.peer = from;
  n.role = static_cast<Role>(h.sender_role);
  n.id = h.sender;
  n.hostname = kv.Get("hostname");
  n.host_key = kv.Get("host_key", n.hostname);
  n.pid = kv.Get("pid");
  n.data_addr = kv.Get("data_addr");
  n.local_addr = kv.Get("local_addr");
  n.machine = kv.Get("machine");
  n.local_rank = KvInt(kv, "local_rank", -1);
  n.local_size = KvInt(kv, "local_size", -1);
  n.last_seen = Clock::now();
  if (n.role != Role::kWorker && n.role != Role::kServer) return;
  nodes_[from] = n;

  // Every node must agree with the scheduler on the settings that shape the
  // data: a disagreement names the setting and both values.
  for (const SharedSetting& s : kSharedSettings) {
    std::string mine = cfg_.Get(s.key, "");
    std::string theirs = kv.Get(s.key, "");
    if (mine != theirs) {
      Fail(std::string("cluster setting '") + s.key + "' disagrees: the scheduler has " + mine +
               ", " + Describe(n) + " has " + theirs + " (set it the same on every node: " +
               s.env + ")",
           out);
      return;
    }
  }
  if (n.role == Role::kWorker && (n.id < 0 || n.id >= num_workers_)) {
    Fail("worker rank " + std::to_string(n.id) + " is outside [0, " +
             std::to_string(num_workers_) + ") (DMLC_WORKER_ID)",
         out);
    return;
  }
  for (const auto& other : nodes_) {
    if (other.first != from && other.second.role == n.role && n.id >= 0 &&
        other.second.id == n.id) {
      Fail("two " + std::string(RoleName(n.role)) + "s claim id " + std::to_string(n.id) +
               ": " + Describe(other.second) + " and " + Describe(n),
           out);
      return;
    }
  }
  BPS_LOG(kInfo, Describe(n) << " joined");
  MaybeWelcome(out);
}

void Scheduler::MaybeWelcome(std::vector<Outgoing>* out) {
  int workers = 0, servers = 0;
  for (const auto& n : nodes_) (n.second.role == Role::kWorker ? workers : servers)++;
  if (workers > num_workers_ || servers > num_servers_) {
    Fail("more nodes joined than the cluster has: " + std::to_string(workers) + " workers (of " +
             std::to_string(num_workers_) + ") and " + std::to_string(servers) + " servers (of " +
             std::to_string(num_servers_) + ")",
         out);
    return;
  }
  if (welcomed_ || workers != num_workers_ || servers != num_servers_) return;
  welcomed_ = true;

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
  std::vector<const Node*> servers_by_id(static_cast<size_t>(num_servers_), nullptr);
  for (Node* s : server_nodes) {
    if (s->id >= num_servers_) {
      Fail("server id " + std::to_string(s->id) + " is outside [0, " +
               std::to_string(num_servers_) + ") (BYTEPS_SERVER_ID)",
           out);
      return;
    }
    servers_by_id[static_cast<size_t>(s->id)] = s;
  }

  // Local rank: workers on one host, in rank order, unless a launcher said.
  std::map<std::string, std::vector<Node*>> by_host;
  for (auto& n : nodes_) {
    if (n.second.role == Role::kWorker) by_host[n.second.host_key].push_back(&n.second);
  }
  // Names the job's local-reduce rendezvous, so two jobs on one host never meet.
  std::random_device rd;
  std::string job_nonce = std::to_string((static_cast<uint64_t>(rd()) << 32) ^ rd());
  std::map<int, std::string> host_of_rank;
  std::map<int, int> host_index_of_rank;
  int host_index = 0;
  for (auto& host : by_host) {
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
      host_of_rank[w->id] = ranks;
      host_index_of_rank[w->id] = host_index;
    }
    ++host_index;
  }

  // Horovod's cross rank and size: the hosts that hold a worker of this
  // worker's local rank, in host order, and this worker's host among them.
  std::map<int, std::vector<int>> hosts_of_local_rank;
  for (auto& kv : nodes_) {
    if (kv.second.role != Role::kWorker) continue;
    hosts_of_local_rank[std::max(kv.second.local_rank, 0)].push_back(
        host_index_of_rank[kv.second.id]);
  }
  for (auto& kv : hosts_of_local_rank) std::sort(kv.second.begin(), kv.second.end());
  bool homogeneous = true;
  for (auto& host : by_host) {
    homogeneous = homogeneous && host.second.size() == by_host.begin()->second.size();
  }

  for (auto& kv : nodes_) {
    Config w;
    w.Set("id", std::to_string(kv.second.id));
    w.Set("num_workers", std::to_string(num_workers_));
    w.Set("num_servers", std::to_string(num_servers_));
    w.Set("local_rank", std::to_string(std::max(kv.second.local_rank, 0)));
    w.Set("local_size", std::to_string(std::max(kv.second.local_size, 1)));
    if (kv.second.role == Role::kWorker) {
      w.Set("num_hosts", std::to_string(by_host.size()));
      w.Set("host_index", std::to_string(host_index_of_rank[kv.second.id]));
      w.Set("host_ranks", host_of_rank[kv.second.id]);
      const std::vector<int>& peers = hosts_of_local_rank[std::max(kv.second.local_rank, 0)];
      int host = host_index_of_rank[kv.second.id];
      w.Set("cross_size", std::to_string(peers.size()));
      w.Set("cross_rank", std::to_string(
          std::lower_bound(peers.begin(), peers.end(), host) - peers.begin()));
      w.Set("homogeneous", homogeneous ? "1" : "0");
      w.Set("job_nonce", job_nonce);
    }
    for (size_t i = 0; i < servers_by_id.size(); ++i) {
      const Node* s = servers_by_id[i];
      std::string key = "server." + std::to_string(i);
      w.Set(key, s ? s->data_addr : "");
      if (s && !s->local_addr.empty()) {
        w.Set(key + ".local", s->local_addr);
        w.Set(key + ".machine", s->machine);
      }
    }
    out->push_back(Reply(kv.first, MsgType::kWelcome, w.Serialize()));
  }
  BPS_LOG(kInfo, "all " << num_workers_ << " workers and " << num_servers_ << " servers met");
}

Scheduler::Assignment Scheduler::Assign(const std::string& name, const std::string& sig,
                                        int dtype, uint64_t bytes) {
  Assignment a;
  // Keys come from the name (so every worker agrees whatever order tensors
  // appear in); the scheduler resolves the rare hash collision.
  uint64_t key = Fnv1a64(name + "|" + sig) & ~(kMaxParts - 1);
  while (key == 0 || used_keys_.count(key)) key += kMaxParts;
  used_keys_.insert(key);
  a.key = key;
  uint64_t elem = DTypeSize(dtype);
  uint64_t part = std::max<uint64_t>(elem, (static_cast<uint64_t>(partition_bytes_) / elem) * elem);
  for (uint64_t off = 0; off < bytes; off += part) {
    uint64_t len = std::min(part, bytes - off);
    size_t best = 0;
    for (size_t s = 1; s < server_load_.size(); ++s) {
      if (server_load_[s] < server_load_[best]) best = s;
    }
    server_load_[best] += len;
    a.servers.push_back(static_cast<int>(best));
  }
  return a;
}

std::string Scheduler::Encode(const Assignment& a) {
  Config c;
  c.Set("key", std::to_string(a.key));
  std::string servers;
  for (size_t i = 0; i < a.servers.size(); ++i) {
    if (i) servers += ",";
    servers += std::to_string(a.servers[i]);
  }
  c.Set("servers", servers);
  return c.Serialize();
}

void Scheduler::OnDeclare(const Peer& from, const FrameHeader& h, const Config& kv,
                          std::vector<Outgoing>* out) {
  std::string name = kv.Get("name");
  std::string sig = kv.Get("sig");
  int rank = nodes_[from].id;
  int64_t bytes = kv.GetInt("bytes", -1);
  size_t elem = DTypeSize(h.dtype);
  std::string invalid;
  if (name.empty() || elem == 0 || bytes < 0 || bytes % static_cast<int64_t>(elem) != 0) {
    invalid = "malformed declaration of tensor '" + name + "'";
  } else if (static_cast<uint64_t>(bytes) / static_cast<uint64_t>(partition_bytes_) >= kMaxParts) {
    invalid = "tensor '" + name + "' (" + std::to_string(bytes) + " bytes) needs more than " +
              std::to_string(kMaxParts) + " partitions; raise BYTEPS_PARTITION_BYTES";
  }
  if (!invalid.empty()) {
    Config c;
    c.Set("error", invalid);
    out->push_back(Reply(from, MsgType::kDeclared, c.Serialize(), h.request_id));
    return;
  }
  auto done = assigned_.find(name + "|" + sig);
  if (done != assigned_.end()) {
    out->push_back(Reply(from, MsgType::kDeclared, Encode(done->second), h.request_id));
    return;
  }
  if (IsAsyncName(name)) {
    // Nobody waits for an asynchronous key (the root writes it before the
    // others read it): the first declaration fixes its signature, and a
    // later one that differs fails instead of waiting.
    auto known = async_sig_.find(name);
    Config c;
    if (known != async_sig_.end()) {
      c.Set("mismatch", "1");
      c.Set("error", "asynchronous tensor '" + name + "' differs across workers: worker " +
                         std::to_string(rank) + " has " + sig + " but it was declared as " +
                         known->second);
      out->push_back(Reply(from, MsgType::kDeclared, c.Serialize(), h.request_id));
      return;
    }
    Assignment a = Assign(name, sig, static_cast<int>(h.dtype), static_cast<uint64_t>(bytes));
    assigned_[name + "|" + sig] = a;
    async_sig_[name] = sig;
    out->push_back(Reply(from, MsgType::kDeclared, Encode(a), h.request_id));
    return;
  }
  std::vector<int> members;
  std::string list = kv.Get("members");
  for (size_t at = 0; !list.empty() && at <= list.size();) {
    size_t comma = list.find(',', at);
    if (comma == std::string::npos) comma = list.size();
    std::string item = list.substr(at, comma - at);
    char* stop = nullptr;
    long r = item.empty() ? -1 : std::strtol(item.c_str(), &stop, 10);
    members.push_back(r >= 0 && *stop == '\0' && r < num_workers_ ? static_cast<int>(r) : -1);
    at = comma + 1;
  }
  bool valid_set = std::find(members.begin(), members.end(), rank) != members.end() ||
                   members.empty();
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i] < 0 || members[i] >= num_workers_ || (i && members[i] <= members[i - 1])) {
      valid_set = false;
    }
  }
  auto reply_error = [&](const Peer& to, uint64_t request_id, const std::string& why) {
    Config c;
    c.Set("error", why);
    if (why.find("differs across workers") != std::string::npos) c.Set("mismatch", "1");
    out->push_back(Reply(to, MsgType::kDeclared, c.Serialize(), request_id));
  };
  if (!valid_set) {
    reply_error(from, h.request_id, "malformed process set [" + list + "] of tensor '" + name +
                                        "' from worker " + std::to_string(rank));
    return;
  }
  auto conflict = set_conflicts_.find(name);
  if (conflict != set_conflicts_.end() && conflict->second.expected.erase(rank)) {
    reply_error(from, h.request_id, conflict->second.error);
    if (conflict->second.expected.empty()) set_conflicts_.erase(conflict);
    return;
  }
  // A key reduced on each host first is declared by one worker per host.
  int contributors = KvInt(kv, "contributors", 0);
  int expected = contributors > 0 ? std::min(contributors, num_workers_) : num_workers_;
  auto& waiting = pending_[name];
  if (waiting.empty()) pending_since_[name] = Clock::now();
  auto overlaps = [](const std::vector<int>& a, const std::vector<int>& b) {
    if (a.empty() || b.empty()) return true;
    for (int r : a) {
      if (std::binary_search(b.begin(), b.end(), r)) return true;
    }
    return false;
  };
  auto describe = [](const std::vector<int>& m) {
    std::string d;
    for (int r : m) d += (d.empty() ? "" : ",") + std::to_string(r);
    return m.empty() ? std::string("the global process set") : "process set [" + d + "]";
  };
  for (const auto& w : waiting) {
    if (w.second.members == members || !overlaps(w.second.members, members)) continue;
    // Members of one name must pass one process set: a round that waited for
    // either set would never complete (or complete with the wrong ranks).
    SetConflict c;
    c.error = "tensor '" + name + "' differs across workers: worker " + std::to_string(w.first) +
              " uses " + describe(w.second.members) + " but worker " + std::to_string(rank) +
              " uses " + describe(members) +
              " (every member must pass the same process_set under one name)";
    BPS_LOG(kError, c.error);
    for (const auto& m : {w.second.members, members}) {
      for (int r = 0; r < num_workers_; ++r) {
        if (m.empty() || std::binary_search(m.begin(), m.end(), r)) c.expected.insert(r);
      }
    }
    std::vector<int> failed;
    for (const auto& other : waiting) {
      if (!overlaps(other.second.members, members) &&
          !overlaps(other.second.members, w.second.members)) {
        continue;  // a disjoint process set using the same name
      }
      reply_error(other.second.peer, other.second.request_id, c.error);
      c.expected.erase(other.first);
      failed.push_back(other.first);
    }
    reply_error(from, h.request_id, c.error);
    c.expected.erase(rank);
    if (!c.expected.empty()) set_conflicts_[name] = c;
    for (int r : failed) waiting.erase(r);
    stall_reported_.erase(name);
    if (waiting.empty()) {
      pending_.erase(name);
      pending_since_.erase(name);
    }
    return;
  }
  waiting[rank] = Pending{expected, sig, from, h.request_id, members, static_cast<int>(h.dtype), bytes};
  MaybeDeclare(name, members, out);
}

int LastToJoin(const std::vector<std::pair<int, uint64_t>>& order) {
  if (order.empty()) return -1;
  // Notices from different workers may be read in another order than they
  // were sent (ZeroMQ serves its peers in turn), so arrival alone can name
  // a worker that joined first. A worker whose join another worker's results
  // had already counted came before that worker's join: the last is the
  // latest arrival that nobody had seen join. Workers whose joins nothing
  // ordered joined at the same time; the arrival order decides among them.
  uint64_t seen_by_others = 0;
  for (const auto& o : order) {
    const uint64_t self = o.first <= kMaxMaskRank ? uint64_t{1} << o.first : 0;
    seen_by_others |= o.second & ~self;
  }
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    if (it->first > kMaxMaskRank || !(seen_by_others >> it->first & 1)) return it->first;
  }
  return order.back().first;
}

void Scheduler::OnJoin(int rank, uint64_t seen, std::vector<Outgoing>* out) {
  if (joined_.insert(rank).second) join_order_.emplace_back(rank, seen);
  std::vector<std::pair<std::string, std::vector<int>>> sets;
  for (const auto& p : pending_) {
    for (const auto& w : p.second) {
      std::pair<std::string, std::vector<int>> one{p.first, w.second.members};
      if (std::find(sets.begin(), sets.end(), one) == sets.end()) sets.push_back(one);
    }
  }
  for (const auto& one : sets) MaybeDeclare(one.first, one.second, out);
  if (joined_.size() < static_cast<size_t>(num_workers_)) return;
  const int last = LastToJoin(join_order_);
  joined_.clear();
  join_order_.clear();
  for (const auto& n : nodes_) {
    if (n.second.role == Role::kWorker && !n.second.departed) {
      out->push_back(Reply(n.first, MsgType::kJoinNotice, "last=" + std::to_string(last)));
    }
  }
}

void Scheduler::MaybeDeclare(const std::string& name, const std::vector<int>& members,
                             std::vector<Outgoing>* out) {
  auto found = pending_.find(name);
  if (found == pending_.end()) return;
  // Every member has declared with this set, or has joined (it pushes nothing).
  // A host sum (local reduce; never a process set) is declared by each
  // host's root only.
  bool by_host = false;
  for (const auto& w : found->second) by_host = by_host || w.second.expected < num_workers_;
  std::vector<int> ranks;
  for (int r = 0; r < num_workers_; ++r) {
    if (!members.empty() && !std::binary_search(members.begin(), members.end(), r)) continue;
    if (by_host && members.empty() && !host_roots_.count(r)) continue;
    auto w = found->second.find(r);
    if (w != found->second.end() && w->second.members == members) {
      ranks.push_back(r);
    } else if (!joined_.count(r)) {
      return;
    }
  }
  if (!ranks.empty()) Complete(name, ranks, out);
}

void Scheduler::Complete(const std::string& name, const std::vector<int>& ranks,
                         std::vector<Outgoing>* out) {
  auto& waiting = pending_[name];
  const Pending& first = waiting.at(ranks.front());
  std::string error;
  for (int r : ranks) {
    const Pending& w = waiting.at(r);
    if (w.sig != first.sig) {
      error = "tensor '" + name + "' differs across workers: worker " +
              std::to_string(ranks.front()) + " has " + first.sig + " but worker " +
              std::to_string(r) + " has " + w.sig +
              " (every worker must push_pull the same shape and dtype under one name, "
              "broadcast from the same root and reduce with the same op)";
      break;
    }
  }
  std::string payload;
  if (!error.empty()) {
    BPS_LOG(kError, error);
    Config c;
    c.Set("error", error);
    c.Set("mismatch", "1");
    payload = c.Serialize();
  } else {
    Assignment a = Assign(name, first.sig, first.dtype, static_cast<uint64_t>(first.bytes));
    assigned_[name + "|" + first.sig] = a;
    payload = Encode(a);
  }
  for (int r : ranks) {
    const Pending& w = waiting.at(r);
    out->push_back(Reply(w.peer, MsgType::kDeclared, payload, w.request_id));
  }
  for (int r : ranks) waiting.erase(r);
  stall_reported_.erase(name);
  if (waiting.empty()) {
    pending_.erase(name);
    pending_since_.erase(name);
  } else {
    pending_since_[name] = Clock::now();  // the other process set's declarations
  }
}

// A declaration waits at the scheduler until every worker has made it, so
// a tensor that only some workers push_pull (a call under a rank-dependent
// branch) waits here forever. Checked on the scheduler's timer, from the
// declarations it holds anyway: nothing is added to a push_pull's path.
void Scheduler::CheckStalls(std::vector<Outgoing>* out) {
  if (stall_check_s_ <= 0 || pending_.empty()) return;
  auto age_of = [this](const std::string& name) {
    auto since = pending_since_.find(name);
    return since == pending_since_.end() ? 0.0 : SecondsSince(since->second);
  };
  bool shutdown = false;
  for (const auto& p : pending_) {
    if (stall_shutdown_s_ > 0 && age_of(p.first) >= stall_shutdown_s_) shutdown = true;
  }
  std::string report;
  double oldest = 0;
  for (const auto& p : pending_) {
    double age = age_of(p.first);
    if (age < stall_check_s_) continue;
    if (!shutdown && stall_reported_.count(p.first)) continue;
    oldest = std::max(oldest, age);
    // Who is awaited: every worker, or the members of the process sets named.
    std::set<int> awaited;
    for (const auto& w : p.second) {
      for (int r = 0; r < num_workers_; ++r) {
        const std::vector<int>& m = w.second.members;
        if (m.empty() || std::binary_search(m.begin(), m.end(), r)) awaited.insert(r);
      }
    }
    std::string have, missing;
    // A host sum is declared by each host's root only.
    bool by_host = !p.second.empty() && p.second.begin()->second.expected < num_workers_;
    for (int r : awaited) {
      if (by_host && !host_roots_.count(r)) continue;
      if (joined_.count(r)) continue;  // it contributes nothing until every worker joins
      std::string& list = p.second.count(r) ? have : missing;
      list += (list.empty() ? "" : ", ") + std::to_string(r);
    }
    report += (report.empty() ? "" : "; ") + std::string("tensor '") + p.first +
              "' submitted by worker(s) " + have + " but not by worker(s) " + missing;
    stall_reported_.insert(p.first);
  }
  if (report.empty()) return;
  std::string message = "stalled for " + std::to_string(static_cast<int>(oldest)) + " s: " +
                        report +
                        " (every worker must make the same push_pull/broadcast calls; "
                        "BYTEPS_STALL_CHECK_TIME_SECONDS=" +
                        std::to_string(static_cast<int>(stall_check_s_)) + ")";
  if (shutdown) {
    Fail(message + "; stopping the job after BYTEPS_STALL_SHUTDOWN_TIME_SECONDS=" +
             std::to_string(static_cast<int>(stall_shutdown_s_)),
         out);
    return;
  }
  BPS_LOG(kWarning, message);
  for (const auto& kv : nodes_) {
    if (!kv.second.departed && kv.second.role == Role::kWorker) {
      out->push_back(Reply(kv.first, MsgType::kStall, message));
    }
  }
}

void Scheduler::Tick(std::vector<Outgoing>* out) {
  if (!fatal_.empty() || !welcomed_ || finished_) return;
  for (const auto& kv : nodes_) {
    const Node& n = kv.second;
    if (n.departed) continue;
    double quiet = SecondsSince(n.last_seen);
    if (quiet > timeout_s_) {
      Fail("lost " + Describe(n) + ": no heartbeat for " + std::to_string(static_cast<int>(quiet)) +
               " s (it died or hung; BYTEPS_TIMEOUT=" + std::to_string(static_cast<int>(timeout_s_)) +
               ")",
           out);
      return;
    }
  }
  CheckStalls(out);
}

}  // namespace bps
