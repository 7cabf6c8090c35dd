#include "worker/local_reduce.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "common/stats.h"
#include "dtypes.h"
#include "math/compressor.h"
#include "math/reduce.h"
#include "transport/protocol.h"
#include "worker/local_reduce_link.h"
#include "worker/worker_engine.h"

namespace bps {

struct LocalReduce::Impl {
  struct Op {
    std::string name, sig, agreement;
    int dtype = 0;
    std::vector<int64_t> shape;
    uint64_t bytes = 0;
    const char* in = nullptr;
    char* out = nullptr;
    int64_t priority = 0;
    bps_done_fn done = nullptr;
    void* ctx = nullptr;
    uint64_t round = 0;
    size_t slot = 0;  // member: the memfd it travels in
    Clock::time_point start = Clock::now();
  };
  // A member's memfds, reused by whichever operation fits, so memory follows
  // the bytes in flight, not the number of names (unnamed eager calls make
  // a new name each time).
  struct Slot {
    std::shared_ptr<SharedRegion> region;
    bool busy = false;
  };
  struct Contribution {
    std::string sig;
    uint64_t round;
    std::shared_ptr<SharedRegion> region;
  };
  struct Gather {  // root: one name's operation this round
    std::unique_ptr<Op> own;
    std::map<int, Contribution> from;
    Clock::time_point since = Clock::now();
  };
  struct Conn {
    std::unique_ptr<LocalLink> link;
    int rank = -1;  // -1 until its HELLO
  };
  struct Finished {
    Gather* gather;
    int status;
    std::string error;
  };

  int rank = 0, root = 0, num_hosts = 1;
  std::vector<int> peers;  // the host's other ranks
  double op_timeout_s = 0;
  int wake_fd = -1, listen_fd = -1;
  std::map<int, Conn> conns;  // by fd
  std::thread thread;
  std::atomic<bool> stop{false};

  std::mutex mu;  // guards the four below
  std::vector<Op*> incoming;
  std::vector<Finished> finished;
  std::string failed;
  bool stopped = false;  // the loop has ended: the engine's callbacks finish ops themselves

  // Loop thread only.
  std::map<std::string, uint64_t> rounds;                      // name -> next round
  std::vector<Slot> slots;                                     // member
  std::map<std::string, std::unique_ptr<Op>> waiting;          // member: name -> op
  std::map<std::string, Gather> gathers;                       // root: name -> this round
  std::map<std::pair<int, uint64_t>, std::shared_ptr<SharedRegion>> member_regions;  // root
  std::map<Gather*, std::unique_ptr<Gather>> running;          // root: in the engine

  bool is_root() const { return rank == root; }
  void Wake() {
    uint64_t one = 1;
    ssize_t n = write(wake_fd, &one, sizeof(one));
    (void)n;
  }

  static LocalPacket Packet(LocalKind kind, int rank, const Op* op, uint64_t round) {
    LocalPacket p;
    p.kind = kind;
    p.rank = rank;
    p.round = round;
    if (op) {
      p.name = op->name;
      p.sig = op->sig;
      p.dtype = op->dtype;
      p.bytes = op->bytes;
    }
    return p;
  }

  std::string Who(int r) const {
    return std::string(r == root ? "the local-reduce root, worker " : "worker ") +
           std::to_string(r) + " on this host";
  }

  // Every pending and later operation fails with `why`.
  void Fail(const std::string& why) {
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

  // `counted`: the engine already counted it (the root's pushed sum).
  void Finish(Op* op, int status, const std::string& error, bool counted = false) {
    if (status == BPS_OK) Stats::Get().local_reduce_ops++;
    if (!counted) (status == BPS_OK ? Stats::Get().ops_done : Stats::Get().ops_failed)++;
    op->done(op->ctx, status, status == BPS_OK ? nullptr : error.c_str());
  }

  Conn* ConnOf(int r) {
    for (auto& c : conns) {
      if (c.second.rank == r) return &c.second;
    }
    return nullptr;
  }

  // Root: tells each contributor of `name` how its operation ended; on
  // success the global sum (in `sum`) goes into each one's memory first.
  void SendResults(Gather& g, const std::string& name, const char* sum, uint64_t bytes,
                   int status, const std::string& error) {
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

  void OnOwn(std::unique_ptr<Op> op) {
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

  void TryRun(const std::string& name) {
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

  // The engine's callback (its I/O thread, or inside Enqueue): the copies
  // back to the members happen on the loop thread.
  static void EngineDone(void* ctx, int status, const char* message) {
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

  void OnFinished(const Finished& f) {
    auto it = running.find(f.gather);
    if (it == running.end()) return;
    Gather& g = *it->second;
    Op* own = g.own.get();
    SendResults(g, own->name, own->out, own->bytes, f.status, f.error);
    Finish(own, f.status, f.error, /*counted=*/true);
    running.erase(it);
  }

  // One packet from a connection; false when the peer is gone or broke
  // the protocol.
  bool Receive(Conn& c) {
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

  void CheckTimeouts() {
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

  void Loop() {
    while (!stop) {
      std::vector<struct pollfd> fds;
      fds.push_back({wake_fd, POLLIN, 0});
      if (listen_fd >= 0) fds.push_back({listen_fd, POLLIN, 0});
      for (auto& c : conns) {
        short ev = POLLIN | (c.second.link->want_write() ? POLLOUT : 0);
        fds.push_back({c.first, ev, 0});
      }
      poll(fds.data(), fds.size(), 200);
      uint64_t count;
      if (fds[0].revents & POLLIN) {
        ssize_t n = read(wake_fd, &count, sizeof(count));
        (void)n;
      }
      std::vector<Op*> ops;
      std::vector<Finished> done;
      std::string fail_all;
      {
        std::lock_guard<std::mutex> lock(mu);
        ops.swap(incoming);
        done.swap(finished);
        fail_all = failed;
      }
      for (auto& f : done) OnFinished(f);
      for (Op* op : ops) {
        std::unique_ptr<Op> owned(op);
        if (!fail_all.empty()) {
          Finish(op, BPS_ERR_UNAVAILABLE, fail_all);
        } else {
          OnOwn(std::move(owned));
        }
      }
      for (size_t i = 1; i < fds.size(); ++i) {
        int fd = fds[i].fd;
        if (fd == listen_fd) {
          if (fds[i].revents & POLLIN) Accept();
          continue;
        }
        auto it = conns.find(fd);
        if (it == conns.end()) continue;
        if (fds[i].revents & POLLOUT) it->second.link->Flush();
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        bool alive = true;
        for (int k = 0; k < 64 && alive; ++k) {
          alive = Receive(it->second);
          if (!(fds[i].revents & POLLIN)) break;
          struct pollfd one{fd, POLLIN, 0};
          if (alive && poll(&one, 1, 0) <= 0) break;
        }
        if (!alive) Drop(fd);
      }
      CheckTimeouts();
    }
  }

  void Accept() {
    int fd = AcceptLocal(listen_fd);
    if (fd >= 0) conns[fd].link.reset(new LocalLink(fd));
  }

  void Drop(int fd) {
    int r = conns[fd].rank;
    conns.erase(fd);  // closes it
    if (r < 0 && is_root()) return;  // a connection that never said who it is
    if (stop) return;
    Fail("local reduce: " + Who(is_root() ? r : root) +
         " closed its connection (it exited or crashed); the push_pulls of this host cannot "
         "complete (BYTEPS_LOCAL_REDUCE=0 makes every worker push on its own)");
  }
};

LocalReduce& LocalReduce::Get() {
  static LocalReduce* lr = new LocalReduce();  // never destroyed: callbacks may outlive exit
  return *lr;
}

bool LocalReduce::active() const { return impl_ != nullptr; }

void LocalReduce::Start(const Config& cfg) {
  Stop();
  WorkerEngine& engine = WorkerEngine::Get();
  WorkerEngine::HostGroup group = engine.host_group();
  // Every worker decides alike from what all know (a host of one worker
  // still pushes with contributors = hosts).
  int64_t mode = cfg.GetInt("local_reduce", -1);
  if (mode == 0 || group.num_hosts >= engine.size() || (mode < 0 && group.num_hosts < 2)) return;
  std::unique_ptr<Impl> impl(new Impl());
  impl->rank = engine.rank();
  impl->root = group.ranks.front();
  impl->num_hosts = group.num_hosts;
  impl->op_timeout_s = cfg.GetDouble("op_timeout_s", 0);
  for (int r : group.ranks) {
    if (r != impl->rank) impl->peers.push_back(r);
  }
  if (!impl->is_root()) impl->peers = {impl->root};
  if (impl->peers.empty()) {
    StartLoop(impl.release());
    return;
  }
  std::string name =
      "bps_tf-local-reduce-" + group.job_nonce + "-" + std::to_string(group.host_index);
  if (impl->is_root()) {
    impl->listen_fd = ListenLocal(name);
  } else {
    int fd = ConnectLocal(name, cfg.GetDouble("rendezvous_timeout_s", 120),
                          "worker " + std::to_string(impl->root) + " (this host's root)");
    Impl::Conn& c = impl->conns[fd];
    c.link.reset(new LocalLink(fd));
    c.rank = impl->root;
    c.link->Send(Impl::Packet(LocalKind::kHello, impl->rank, nullptr, 0));
  }
  BPS_LOG(kInfo, "local reduce on host " << group.host_index << " with its root, worker "
                                          << impl->root);
  StartLoop(impl.release());
}

void LocalReduce::StartLoop(Impl* impl) {
  impl->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  impl->thread = std::thread([impl] { impl->Loop(); });
  impl_ = impl;
}

void LocalReduce::Stop() {
  Impl* impl = impl_;
  if (!impl) return;
  impl_ = nullptr;
  impl->stop = true;
  impl->Wake();
  impl->thread.join();
  std::vector<Impl::Op*> leftover;
  std::vector<Impl::Finished> done;
  {
    std::lock_guard<std::mutex> lock(impl->mu);
    impl->stopped = true;
    leftover.swap(impl->incoming);
    done.swap(impl->finished);
  }
  std::string why = "bps_tf was shut down while this push_pull was in progress";
  for (auto& w : impl->waiting) impl->Finish(w.second.get(), BPS_ERR_UNAVAILABLE, why);
  for (auto& g : impl->gathers) {
    if (g.second.own) impl->Finish(g.second.own.get(), BPS_ERR_UNAVAILABLE, why);
  }
  for (Impl::Op* op : leftover) {
    impl->Finish(op, BPS_ERR_UNAVAILABLE, why);
    delete op;
  }
  if (impl->listen_fd >= 0) close(impl->listen_fd);
  impl->waiting.clear();
  impl->gathers.clear();
  impl->conns.clear();
  for (auto& f : done) impl->OnFinished(f);
  // Operations still in the engine call back into it, so it (and its
  // eventfd, which a late Wake() may still write) stays allocated.
}

void LocalReduce::Enqueue(const std::string& name, int dtype, const std::vector<int64_t>& shape,
                          const void* in, void* out, int64_t priority, bps_done_fn done, void* ctx,
                          const std::string& compression, const std::string& agreement) {
  Impl* impl = impl_;
  bool bypass = impl == nullptr || IsAsyncName(name) || DTypeSize(dtype) == 0;
  // A process set's members push for themselves: a host sum could mix
  // members and non-members, and the servers count a set by its member mask.
  bypass = bypass || (" " + agreement).find(" set=") != std::string::npos;
  if (!bypass && !compression.empty()) {
    try {
      bypass = CompressorSpec::Parse(compression).active();
    } catch (const Error&) {
      bypass = true;  // the engine reports it
    }
  }
  for (int64_t d : shape) bypass = bypass || d < 0;
  if (bypass) {
    WorkerEngine::Get().Enqueue(name, dtype, shape, in, out, priority, done, ctx, compression,
                                agreement);
    return;
  }
  auto* op = new Impl::Op();
  op->name = name;
  op->dtype = dtype;
  op->shape = shape;
  op->bytes = DTypeSize(dtype);
  for (int64_t d : shape) op->bytes *= static_cast<uint64_t>(d);
  op->sig = ShapeString(dtype, shape) + (agreement.empty() ? "" : " " + agreement);
  op->agreement = agreement;
  op->in = static_cast<const char*>(in);
  op->out = static_cast<char*>(out);
  op->priority = priority;
  op->done = done;
  op->ctx = ctx;
  {
    std::lock_guard<std::mutex> lock(impl->mu);
    if (!impl->stopped) {
      impl->incoming.push_back(op);
      impl->Wake();
      return;
    }
  }
  impl->Finish(op, BPS_ERR_NOT_INITIALIZED, "bps_tf is not initialized: call bps_tf.init() first");
  delete op;
}

}  // namespace bps
