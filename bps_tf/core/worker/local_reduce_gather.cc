// What local reduce's loop thread does with each operation: a member
// contributes it through its memfd, the root gathers the host's
// contributions, sums them and pushes the host's sum, then writes the
// global sum back into each member's memory; failures and time-outs.
#include <algorithm>
#include <cstring>

#include "common/stats.h"
#include "dtypes.h"
#include "math/reduce.h"
#include "worker/local_reduce_impl.h"
#include "worker/worker_engine.h"

namespace bps {

void LocalReduce::Impl::Fail(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (failed.empty()) failed = why;
  }
  BPS_LOG(kError, why);
  for (auto& w : waiting) Finish(w.second.get(), BPS_ERR_UNAVAILABLE, why);
  waiting.clear();
  for (auto& g : gathers) {
    if (g.second.own) Finish(g.second.own.get(), BPS_ERR_UNAVAILABLE, why);
    SendResults(g.second, g.first, nullptr, 0, BPS_ERR_UNAVAILABLE, why);
  }
  gathers.clear();
}

void LocalReduce::Impl::Finish(Op* op, int status, const std::string& error, bool counted) {
  if (status == BPS_OK) Stats::Get().local_reduce_ops++;
  if (!counted) (status == BPS_OK ? Stats::Get().ops_done : Stats::Get().ops_failed)++;
  op->done(op->ctx, status, status == BPS_OK ? nullptr : error.c_str());
}

LocalReduce::Impl::Conn* LocalReduce::Impl::ConnOf(int r) {
  for (auto& c : conns) {
    if (c.second.rank == r) return &c.second;
  }
  return nullptr;
}

void LocalReduce::Impl::SendResults(Gather& g, const std::string& name, const char* sum,
                                    uint64_t bytes, int status, const std::string& error) {
  for (auto& f : g.from) {
    if (status == BPS_OK && sum && bytes) std::memcpy(f.second.region->data, sum, bytes);
    Conn* c = ConnOf(f.first);
    if (!c) continue;
    LocalPacket p = Packet(LocalKind::kResult, rank, nullptr, f.second.round);
    p.name = name;
    p.status = status;
    p.text = error;
    c->link->Send(std::move(p));
  }
}

void LocalReduce::Impl::OnOwn(std::unique_ptr<Op> op) {
  op->round = rounds[op->name]++;
  if (!is_root()) {
    if (waiting.count(op->name)) {
      Finish(op.get(), BPS_ERR_INVALID,
             "push_pull '" + op->name + "' was started again before the previous one finished; "
             "names must be unique among operations in flight");
      return;
    }
    Conn* c = ConnOf(root);
    if (!c) {
      Finish(op.get(), BPS_ERR_UNAVAILABLE, "local reduce: " + Who(root) + " is gone");
      return;
    }
    size_t slot = slots.size();
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i].busy || slots[i].region->bytes < op->bytes) continue;
      if (slot == slots.size() || slots[i].region->bytes < slots[slot].region->bytes) slot = i;
    }
    int fd = -1;
    if (slot == slots.size()) {
      try {
        slots.push_back(Slot{CreateShared(op->bytes, &fd), false});
      } catch (const std::exception& e) {
        Finish(op.get(), BPS_ERR_INTERNAL, "push_pull '" + op->name + "': " + e.what());
        return;
      }
    }
    Slot& s = slots[slot];
    s.busy = true;
    op->slot = slot;
    if (op->bytes) std::memcpy(s.region->data, op->in, op->bytes);
    LocalPacket p = Packet(LocalKind::kContrib, rank, op.get(), op->round);
    p.slot = slot;
    p.slot_bytes = s.region->bytes;
    p.fd = fd;  // a new memfd: the root maps it once
    c->link->Send(std::move(p));
    waiting[op->name] = std::move(op);
    return;
  }
  Gather& g = gathers[op->name];
  if (g.own) {
    Finish(op.get(), BPS_ERR_INVALID,
           "push_pull '" + op->name + "' was started again before the previous one finished; "
           "names must be unique among operations in flight");
    return;
  }
  g.own = std::move(op);
  TryRun(g.own->name);
}

void LocalReduce::Impl::TryRun(const std::string& name) {
  auto it = gathers.find(name);
  Gather& g = it->second;
  if (!g.own || g.from.size() < peers.size()) return;
  Op* own = g.own.get();
  std::string agreement = own->agreement;
  for (auto& f : g.from) {
    if (f.second.sig != own->sig || f.second.round != own->round) {
      // Declared anyway under a signature no other host has, so the
      // scheduler fails this name on every worker (the other hosts would
      // otherwise wait for this host's push).
      agreement += " [differs on this host: worker " + std::to_string(rank) + " has " +
                   own->sig + " (call " + std::to_string(own->round) + "), worker " +
                   std::to_string(f.first) + " has " + f.second.sig + " (call " +
                   std::to_string(f.second.round) + ")]";
      break;
    }
  }
  if (own->bytes && own->out != own->in) std::memcpy(own->out, own->in, own->bytes);
  size_t count = own->bytes / std::max<size_t>(DTypeSize(own->dtype), 1);
  if (agreement == own->agreement) {
    for (auto& f : g.from) SumInto(own->dtype, own->out, f.second.region->data, count);
  }
  auto moved = std::unique_ptr<Gather>(new Gather(std::move(g)));
  gathers.erase(it);
  Gather* key = moved.get();
  running[key] = std::move(moved);
  WorkerEngine::Get().Enqueue(own->name, own->dtype, own->shape, own->out, own->out,
                              own->priority, &Impl::EngineDone, new std::pair<Impl*, Gather*>(this, key),
                              "", agreement, 0, static_cast<uint32_t>(num_hosts));
}

void LocalReduce::Impl::EngineDone(void* ctx, int status, const char* message) {
  auto* pair = static_cast<std::pair<Impl*, Gather*>*>(ctx);
  Impl* self = pair->first;
  Finished f{pair->second, status, message ? message : ""};
  delete pair;
  {
    std::lock_guard<std::mutex> lock(self->mu);
    if (!self->stopped) {
      self->finished.push_back(f);
      self->Wake();
      return;
    }
  }
  // After Stop() (the engine fails what it still holds): no members to
  // answer any more, but the root's own caller must hear back.
  auto it = self->running.find(f.gather);
  if (it == self->running.end()) return;
  self->Finish(it->second->own.get(), f.status, f.error, /*counted=*/true);
  self->running.erase(it);
}

void LocalReduce::Impl::OnFinished(const Finished& f) {
  auto it = running.find(f.gather);
  if (it == running.end()) return;
  Gather& g = *it->second;
  Op* own = g.own.get();
  SendResults(g, own->name, own->out, own->bytes, f.status, f.error);
  Finish(own, f.status, f.error, /*counted=*/true);
  running.erase(it);
}

bool LocalReduce::Impl::Receive(Conn& c) {
  LocalPacket p;
  int got = c.link->Receive(&p);
  if (got <= 0) return got == 0;
  std::unique_ptr<int, void (*)(int*)> fd_guard(&p.fd, [](int* fd) {
    if (*fd >= 0) close(*fd);
  });
  switch (p.kind) {
    case LocalKind::kHello: {
      bool known = std::find(peers.begin(), peers.end(), p.rank) != peers.end();
      if (!is_root() || c.rank >= 0 || !known || ConnOf(p.rank)) return false;
      c.rank = p.rank;
      return true;
    }
    case LocalKind::kContrib: {
      if (!is_root() || c.rank < 0) return false;
      auto& region = member_regions[{c.rank, p.slot}];
      if (p.fd >= 0) {
        try {
          region = MapShared(p.fd, p.slot_bytes);
        } catch (const std::exception& e) {
          Fail(e.what());
          return true;
        }
      }
      if (!region || region->bytes < p.bytes) return false;
      gathers[p.name].from[c.rank] = Contribution{p.sig, p.round, region};
      TryRun(p.name);
      return true;
    }
    case LocalKind::kResult: {
      auto it = waiting.find(p.name);
      if (is_root() || it == waiting.end() || it->second->round != p.round) return true;
      Op* op = it->second.get();
      if (p.status == BPS_OK && op->bytes) {
        std::memcpy(op->out, slots[op->slot].region->data, op->bytes);
      }
      slots[op->slot].busy = false;
      Finish(op, p.status, p.text);
      waiting.erase(it);
      return true;
    }
  }
  return false;
}

void LocalReduce::Impl::CheckTimeouts() {
  if (op_timeout_s <= 0) return;
  for (auto it = waiting.begin(); it != waiting.end();) {
    if (SecondsSince(it->second->start) < op_timeout_s) {
      ++it;
      continue;
    }
    Finish(it->second.get(), BPS_ERR_TIMEOUT,
           "push_pull '" + it->first + "' timed out after BYTEPS_OP_TIMEOUT=" +
               std::to_string(op_timeout_s) + " s waiting for " + Who(root));
    // Its slot stays busy: a late result may still be written into it.
    it = waiting.erase(it);
  }
  for (auto it = gathers.begin(); it != gathers.end();) {
    if (SecondsSince(it->second.since) < op_timeout_s) {
      ++it;
      continue;
    }
    std::string missing;
    for (int p : peers) {
      if (!it->second.from.count(p)) missing += (missing.empty() ? "" : ", ") + std::to_string(p);
    }
    if (!it->second.own) missing += (missing.empty() ? "" : ", ") + std::to_string(rank);
    std::string why = "push_pull '" + it->first + "' timed out after BYTEPS_OP_TIMEOUT=" +
                      std::to_string(op_timeout_s) + " s waiting for worker(s) " + missing +
                      " on this host";
    if (it->second.own) Finish(it->second.own.get(), BPS_ERR_TIMEOUT, why);
    SendResults(it->second, it->first, nullptr, 0, BPS_ERR_TIMEOUT, why);
    it = gathers.erase(it);
  }
}

}  // namespace bps
