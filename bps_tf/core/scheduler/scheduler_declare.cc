// The scheduler's tensor declarations: every worker's declaration of a name
// is compared, and the partitions placed on servers, before any data moves
// (a process set's declarations wait for its members only); join() and the
// check for declarations that some workers never make. Meeting is in
// scheduler.cc.
#include <algorithm>
#include <cstdlib>

#include "scheduler/scheduler.h"

namespace bps {

Scheduler::Assignment Scheduler::Assign(const std::string& name, const std::string& sig,
                                        int dtype, uint64_t bytes) {
  Assignment a;
  // Keys come from the name (so every worker agrees whatever order tensors
  // appear in); the scheduler resolves the rare hash collision.
  uint64_t key = Fnv1a64(name + "|" + sig) & ~(kMaxParts - 1);
  while (key == 0 || used_keys_.count(key)) key += kMaxParts;
  used_keys_.insert(key);
  a.key = key;
  a.dtype = dtype;
  a.bytes = bytes;
  a.servers = Place(dtype, bytes);
  return a;
}

std::vector<int> Scheduler::Place(int dtype, uint64_t bytes) {
  std::vector<int> servers;
  if (server_load_.empty()) server_load_.assign(1, 0);
  const uint64_t part = PartitionBytes(partition_bytes_, DTypeSize(dtype));
  for (uint64_t off = 0; off < bytes; off += part) {
    uint64_t len = std::min(part, bytes - off);
    size_t best = 0;
    for (size_t s = 1; s < server_load_.size(); ++s) {
      if (server_load_[s] < server_load_[best]) best = s;
    }
    server_load_[best] += len;
    servers.push_back(static_cast<int>(best));
  }
  return servers;
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

namespace {
bool Overlaps(const std::vector<int>& a, const std::vector<int>& b) {
  if (a.empty() || b.empty()) return true;
  for (int r : a) {
    if (std::binary_search(b.begin(), b.end(), r)) return true;
  }
  return false;
}

std::string DescribeSet(const std::vector<int>& m) {
  std::string d;
  for (int r : m) d += (d.empty() ? "" : ",") + std::to_string(r);
  return m.empty() ? std::string("the global process set") : "process set [" + d + "]";
}
}  // namespace

void Scheduler::OnDeclare(const Peer& from, const FrameHeader& h, const Config& kv,
                          std::vector<Outgoing>* out) {
  std::string name = kv.Get("name");
  std::string sig = kv.Get("sig");
  int rank = nodes_[from].id;
  int64_t bytes = kv.GetInt("bytes", -1);
  size_t elem = DTypeSize(h.dtype);
  // Each partition's index lives in the low kPartBits of its key.
  const uint64_t part = PartitionBytes(partition_bytes_, elem);
  const uint64_t parts = bytes < 0 ? 0 : (static_cast<uint64_t>(bytes) + part - 1) / part;
  std::string invalid;
  if (name.empty() || elem == 0 || bytes < 0 || bytes % static_cast<int64_t>(elem) != 0) {
    invalid = "malformed declaration of tensor '" + name + "'";
  } else if (parts >= kMaxParts) {
    invalid = "tensor '" + name + "' (" + std::to_string(bytes) + " bytes) needs " +
              std::to_string(parts) + " partitions of " + std::to_string(part) +
              " bytes, more than the " + std::to_string(kMaxParts - 1) +
              " a tensor may have; raise BYTEPS_PARTITION_BYTES (or BYTEPS_LINK_RATE, which "
              "sizes it)";
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
  if (IsAsyncName(name)) return DeclareAsync(from, h, name, sig, rank, bytes, out);
  std::vector<int> members;
  std::string list = kv.Get("members");
  if (!ParseMembers(list, rank, &members)) {
    ReplyError(from, h.request_id, "malformed process set [" + list + "] of tensor '" + name +
                                       "' from worker " + std::to_string(rank), out);
    return;
  }
  auto conflict = set_conflicts_.find(name);
  if (conflict != set_conflicts_.end() && conflict->second.expected.erase(rank)) {
    ReplyError(from, h.request_id, conflict->second.error, out);
    if (conflict->second.expected.empty()) set_conflicts_.erase(conflict);
    return;
  }
  // A key reduced on each host first is declared by one worker per host.
  int contributors = KvInt(kv, "contributors", 0);
  int expected = contributors > 0 ? std::min(contributors, num_workers_) : num_workers_;
  auto& waiting = pending_[name];
  if (waiting.empty()) pending_since_[name] = Clock::now();
  if (RefuseOtherSet(name, rank, from, h.request_id, members, out)) return;
  waiting[rank] = Pending{expected, sig, from, h.request_id, members, static_cast<int>(h.dtype), bytes};
  MaybeDeclare(name, members, out);
}

void Scheduler::DeclareAsync(const Peer& from, const FrameHeader& h, const std::string& name,
                             const std::string& sig, int rank, int64_t bytes,
                             std::vector<Outgoing>* out) {
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
}

bool Scheduler::ParseMembers(const std::string& list, int rank, std::vector<int>* members) const {
  for (size_t at = 0; !list.empty() && at <= list.size();) {
    size_t comma = list.find(',', at);
    if (comma == std::string::npos) comma = list.size();
    std::string item = list.substr(at, comma - at);
    char* stop = nullptr;
    long r = item.empty() ? -1 : std::strtol(item.c_str(), &stop, 10);
    members->push_back(r >= 0 && *stop == '\0' && r < num_workers_ ? static_cast<int>(r) : -1);
    at = comma + 1;
  }
  bool valid_set = std::find(members->begin(), members->end(), rank) != members->end() ||
                   members->empty();
  for (size_t i = 0; i < members->size(); ++i) {
    const std::vector<int>& m = *members;
    if (m[i] < 0 || m[i] >= num_workers_ || (i && m[i] <= m[i - 1])) valid_set = false;
  }
  return valid_set;
}

void Scheduler::ReplyError(const Peer& to, uint64_t request_id, const std::string& why,
                           std::vector<Outgoing>* out) {
  Config c;
  c.Set("error", why);
  if (why.find("differs across workers") != std::string::npos) c.Set("mismatch", "1");
  out->push_back(Reply(to, MsgType::kDeclared, c.Serialize(), request_id));
}

bool Scheduler::RefuseOtherSet(const std::string& name, int rank, const Peer& from,
                               uint64_t request_id, const std::vector<int>& members,
                               std::vector<Outgoing>* out) {
  auto& waiting = pending_[name];
  for (const auto& w : waiting) {
    if (w.second.members == members || !Overlaps(w.second.members, members)) continue;
    // Members of one name must pass one process set: a round that waited for
    // either set would never complete (or complete with the wrong ranks).
    SetConflict c;
    c.error = "tensor '" + name + "' differs across workers: worker " + std::to_string(w.first) +
              " uses " + DescribeSet(w.second.members) + " but worker " + std::to_string(rank) +
              " uses " + DescribeSet(members) +
              " (every member must pass the same process_set under one name)";
    BPS_LOG(kError, c.error);
    for (const auto& m : {w.second.members, members}) {
      for (int r = 0; r < num_workers_; ++r) {
        if (m.empty() || std::binary_search(m.begin(), m.end(), r)) c.expected.insert(r);
      }
    }
    std::vector<int> failed;
    for (const auto& other : waiting) {
      if (!Overlaps(other.second.members, members) &&
          !Overlaps(other.second.members, w.second.members)) {
        continue;  // a disjoint process set using the same name
      }
      ReplyError(other.second.peer, other.second.request_id, c.error, out);
      c.expected.erase(other.first);
      failed.push_back(other.first);
    }
    ReplyError(from, request_id, c.error, out);
    c.expected.erase(rank);
    if (!c.expected.empty()) set_conflicts_[name] = c;
    for (int r : failed) waiting.erase(r);
    stall_reported_.erase(name);
    if (waiting.empty()) {
      pending_.erase(name);
      pending_since_.erase(name);
    }
    return true;
  }
  return false;
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

}  // namespace bps
