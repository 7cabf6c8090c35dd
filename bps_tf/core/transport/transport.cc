#include "transport/transport.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <thread>

#include "common/common.h"
#include "common/stats.h"

namespace bps {

Msg::Msg(size_t size) {
  if (zmq_msg_init_size(&m_, size) != 0) throw Error(ZmqError("allocating a message"));
}

Msg::Msg(const void* data, size_t size) : Msg(size) {
  if (size) std::memcpy(zmq_msg_data(&m_), data, size);
}

Msg::Msg(void* data, size_t size, zmq_free_fn* free_fn, void* hint) {
  if (zmq_msg_init_data(&m_, data, size, free_fn, hint) != 0) {
    throw Error(ZmqError("wrapping a buffer"));
  }
}

Msg::Msg(Msg&& other) noexcept {
  zmq_msg_init(&m_);
  zmq_msg_move(&m_, &other.m_);
}

Msg& Msg::operator=(Msg&& other) noexcept {
  if (this != &other) zmq_msg_move(&m_, &other.m_);  // closes our old content
  return *this;
}

Msg Msg::Share() {
  Msg copy;
  zmq_msg_copy(copy.raw(), &m_);
  return copy;
}

std::string Endpoint(const std::string& host, int64_t port) {
  bool v6 = host.find(':') != std::string::npos && host.front() != '[';
  return "tcp://" + (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

std::string ZmqError(const std::string& what) {
  int e = zmq_errno();
  return what + ": " + zmq_strerror(e);
}

Context::Context(int io_threads) : ctx_(zmq_ctx_new()) {
  if (!ctx_) throw Error(ZmqError("creating a ZeroMQ context"));
  zmq_ctx_set(ctx_, zmqc::kIoThreads, io_threads < 1 ? 1 : io_threads);
  // A link is three libzmq sockets (its own, its handshake watch and the
  // monitor's): the default of 1023 per context stopped a worker at about
  // 340 servers. The largest this libzmq allows instead.
  const int limit = zmq_ctx_get(ctx_, zmqc::kSocketLimit);
  if (limit > 1023) zmq_ctx_set(ctx_, zmqc::kMaxSockets, std::min(limit, 65535));
}

Context::~Context() { zmq_ctx_term(ctx_); }

Socket::Socket(Context& ctx, int type, const std::string& routing_id)
    : sock_(zmq_socket(ctx.get(), type)) {
  if (!sock_) throw Error(ZmqError("creating a socket"));
  // Unlimited queues: the credit bounds what a worker has in flight, and a
  // full queue would make ROUTER drop messages silently.
  int zero = 0;
  zmq_setsockopt(sock_, zmqc::kSndHwm, &zero, sizeof(zero));
  zmq_setsockopt(sock_, zmqc::kRcvHwm, &zero, sizeof(zero));
  if (type == zmqc::kRouter) {
    int one = 1;  // report unknown peers instead of dropping silently
    zmq_setsockopt(sock_, zmqc::kRouterMandatory, &one, sizeof(one));
  }
  if (!routing_id.empty()) {
    zmq_setsockopt(sock_, zmqc::kRoutingId, routing_id.data(), routing_id.size());
  }
  SetLinger(0);
}

void Socket::SetLinger(int ms) { zmq_setsockopt(sock_, zmqc::kLinger, &ms, sizeof(ms)); }

void Socket::SetReconnectInterval(int ms) {
  zmq_setsockopt(sock_, zmqc::kReconnectIvl, &ms, sizeof(ms));
}

void Socket::SetMaxMsgSize(int64_t bytes) {
  zmq_setsockopt(sock_, zmqc::kMaxMsgSize, &bytes, sizeof(bytes));
}

void Socket::SetBacklog(int connections) {
  zmq_setsockopt(sock_, zmqc::kBacklog, &connections, sizeof(connections));
}

int KernelListenBacklog() {
  std::ifstream in("/proc/sys/net/core/somaxconn");
  long cap = 0;
  if (!(in >> cap) || cap <= 0) return 4096;
  return static_cast<int>(std::min<long>(cap, 1 << 20));
}

#ifndef TCP_NOTSENT_LOWAT
#define TCP_NOTSENT_LOWAT 25
#endif

// Without a cap the kernel takes megabytes from libzmq (autotuned send
// buffers), and an urgent partition queued behind them waits for all of
// them to leave: the priority queue can only reorder what the kernel has
// not taken. An fd closed (and even reused) since libzmq reported it only
// makes the call fail or touch another TCP socket of this process, both
// harmless.
void CapUnsentBytes(int fd, int bytes) {
  if (bytes <= 0) return;
  if (setsockopt(fd, IPPROTO_TCP, TCP_NOTSENT_LOWAT, &bytes, sizeof(bytes)) != 0) {
    BPS_LOG(kDebug, "TCP_NOTSENT_LOWAT on fd " << fd << ": " << std::strerror(errno));
  } else {
    Stats::Get().connections_capped++;
  }
}

void Socket::Connect(const std::string& endpoint) {
  if (zmq_connect(sock_, endpoint.c_str()) != 0) {
    throw Error(ZmqError("connecting to " + endpoint));
  }
}

std::string Socket::Bind(const std::string& endpoint) {
  if (zmq_bind(sock_, endpoint.c_str()) != 0) {
    throw Error(ZmqError("binding " + endpoint + (IsIpcEndpoint(endpoint)
                                                      ? " (is the name already taken?)"
                                                      : " (is the port already taken?)")));
  }
  char buf[256];
  size_t len = sizeof(buf);
  zmq_getsockopt(sock_, zmqc::kLastEndpoint, buf, &len);
  return std::string(buf, len > 0 ? strnlen(buf, len) : 0);
}

void Socket::Close() {
  if (sock_) {
    zmq_close(sock_);
    sock_ = nullptr;
  }
}

bool Socket::RecvFrames(std::vector<Msg>* frames) {
  frames->clear();
  bool first = true;
  while (true) {
    Msg m;
    int rc = zmq_msg_recv(m.raw(), sock_, first ? zmqc::kDontWait : 0);
    if (rc < 0) {
      if (first) return false;  // nothing waiting
      frames->clear();          // broken multipart: drop it
      return false;
    }
    first = false;
    bool more = zmq_msg_more(m.raw());
    frames->push_back(std::move(m));
    if (!more) return true;
  }
}

bool Socket::SendFrames(std::vector<Msg>* frames) {
  for (size_t i = 0; i < frames->size(); ++i) {
    // Never blocks: the queues are unlimited, so only a socket left without
    // any connection (a local link, which does not reconnect, to a server
    // that is gone) would wait, and forever; it fails with EAGAIN instead.
    int flags = zmqc::kDontWait | (i + 1 < frames->size() ? zmqc::kSndMore : 0);
    if (zmq_msg_send((*frames)[i].raw(), sock_, flags) < 0) return false;
  }
  return true;
}

Wakeup::Wakeup() : fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (fd_ < 0) throw Error(std::string("eventfd: ") + std::strerror(errno));
}

Wakeup::~Wakeup() { close(fd_); }

void Wakeup::Notify() {
  // One write per wake-up is enough: the woken thread drains before it
  // looks at its queues, so whatever was queued before the drain is seen.
  if (pending_.exchange(true)) return;
  uint64_t one = 1;
  ssize_t n = write(fd_, &one, sizeof(one));
  (void)n;
}

void Wakeup::Drain() {
  // Read first, then clear. Clearing first lets a Notify in between write
  // a count this read then swallows while `pending_` stays set: every later
  // Notify would skip its write and the owner would sleep out its whole
  // poll timeout on each wake-up (100 ms per message on a quiet channel).
  // In this order a Notify that sees `pending_` set was queued before the
  // clear, so the drained thread, which looks at its queues next, sees it.
  uint64_t v;
  while (read(fd_, &v, sizeof(v)) > 0) {
  }
  pending_.store(false);
}

long WakeupLostCount(long items, int timeout_ms) {
  Wakeup wake;
  std::mutex mu;
  long queued = 0, taken = 0, lost = 0;
  std::thread consumer([&] {
    while (true) {
      pollfd p{wake.fd(), POLLIN, 0};
      int ready = poll(&p, 1, timeout_ms);
      if (ready > 0) wake.Drain();
      std::lock_guard<std::mutex> lock(mu);
      if (ready == 0 && queued > 0) ++lost;
      taken += queued;
      queued = 0;
      if (taken == items) return;
    }
  });
  std::mt19937 rng(12345);
  for (long i = 0; i < items; ++i) {
    for (volatile unsigned spin = rng() % 512; spin > 0; spin = spin - 1) {
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      ++queued;
    }
    wake.Notify();
  }
  consumer.join();
  return lost;
}

bool SocketHasInput(void* socket) {
  int events = 0;
  size_t len = sizeof(events);
  return zmq_getsockopt(socket, zmqc::kEvents, &events, &len) == 0 &&
         (events & zmqc::kPollIn) != 0;
}

int SocketSignalFd(void* socket) {
  int fd = -1;
  size_t len = sizeof(fd);
  if (zmq_getsockopt(socket, zmqc::kFd, &fd, &len) != 0) {
    throw Error(ZmqError("reading a socket's signal fd"));
  }
  return fd;
}

}  // namespace bps
