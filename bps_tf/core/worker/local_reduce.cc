// Local reduce's face (local_reduce.h): starting and stopping, taking an
// operation, and the loop thread with its connections. What the loop does
// with an operation is in local_reduce_gather.cc.
#include "worker/local_reduce.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <memory>
#include <mutex>
#include <thread>

#include "dtypes.h"
#include "math/compressor.h"
#include "transport/protocol.h"
#include "worker/local_reduce_impl.h"
#include "worker/worker_engine.h"

namespace bps {

void LocalReduce::Impl::Loop() {
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

void LocalReduce::Impl::Accept() {
  int fd = AcceptLocal(listen_fd);
  if (fd >= 0) conns[fd].link.reset(new LocalLink(fd));
}

void LocalReduce::Impl::Drop(int fd) {
  int r = conns[fd].rank;
  conns.erase(fd);  // closes it
  if (r < 0 && is_root()) return;  // a connection that never said who it is
  if (stop) return;
  const std::string why = "local reduce: " + Who(is_root() ? r : root) +
                          " closed its connection (it exited or crashed); the push_pulls of "
                          "this host cannot complete (BYTEPS_LOCAL_REDUCE=0 makes every worker "
                          "push on its own)";
  if (waiting.empty() && gathers.empty()) {
    // Nothing of this host was lost: at a job's end a worker of it simply
    // exits first. A later push_pull here still fails with the reason.
    std::lock_guard<std::mutex> lock(mu);
    if (failed.empty()) failed = why;
    BPS_LOG(kInfo, why);
    return;
  }
  Fail(why);
}

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
  impl->thread = std::thread([impl] {
    NameThisThread("bps-local-sum");
    impl->Loop();
  });
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
