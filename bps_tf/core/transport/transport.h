// Thin RAII wrappers over the libzmq calls bps_tf makes: messages, sockets,
// multipart send/receive and a wake-up fd for I/O threads. Sockets are owned
// by exactly one thread; other threads hand work over through queues and
// Wakeup::Notify().
#ifndef BPS_TF_CORE_TRANSPORT_TRANSPORT_H_
#define BPS_TF_CORE_TRANSPORT_TRANSPORT_H_

#include <atomic>
#include <string>
#include <vector>

#include "transport/protocol.h"
#include "transport/zmq_api.h"

namespace bps {

class Msg {
 public:
  Msg() { zmq_msg_init(&m_); }
  explicit Msg(size_t size);
  Msg(const void* data, size_t size);  // copies
  // Zero-copy: `free_fn(data, hint)` runs once libzmq no longer needs data.
  Msg(void* data, size_t size, zmq_free_fn* free_fn, void* hint);
  ~Msg() { zmq_msg_close(&m_); }
  Msg(Msg&& other) noexcept;
  Msg& operator=(Msg&& other) noexcept;
  Msg(const Msg&) = delete;
  Msg& operator=(const Msg&) = delete;

  Msg Share();  // another reference to the same bytes (no copy for large ones)
  char* data() { return static_cast<char*>(zmq_msg_data(&m_)); }
  // libzmq's accessor takes no const message, though it only reads it.
  const char* data() const {
    return static_cast<const char*>(zmq_msg_data(const_cast<zmq_msg_t*>(&m_)));
  }
  size_t size() const { return zmq_msg_size(&m_); }
  std::string str() const { return std::string(data(), size()); }
  zmq_msg_t* raw() { return &m_; }

 private:
  zmq_msg_t m_;
};

std::string ZmqError(const std::string& what);

// "tcp://host:port", bracketing IPv6 literals.
std::string Endpoint(const std::string& host, int64_t port);
// A Unix-socket endpoint (ipc://...), reached only from this machine.
inline bool IsIpcEndpoint(const std::string& endpoint) {
  return endpoint.compare(0, 6, "ipc://") == 0;
}

// How many connections a listening socket may have waiting to be accepted:
// the kernel's cap (net.core.somaxconn), which listen() clamps any larger
// request to; 4096 when it cannot be read.
int KernelListenBacklog();

// Caps the bytes a TCP connection keeps in the kernel not yet sent (0: the
// kernel's default); counted in Stats::connections_capped.
void CapUnsentBytes(int fd, int bytes);

class Context {
 public:
  explicit Context(int io_threads);
  ~Context();
  void* get() { return ctx_; }

 private:
  void* ctx_;
};

class Socket {
 public:
  Socket(Context& ctx, int type, const std::string& routing_id = "");
  ~Socket() { Close(); }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  void SetLinger(int ms);
  void SetReconnectInterval(int ms);  // -1: never reconnect once the connection is lost
  void SetMaxMsgSize(int64_t bytes);
  void SetBacklog(int connections);   // of a socket that binds; before Bind
  void Connect(const std::string& endpoint);
  // Binds and returns the endpoint actually bound (port 0 picks one).
  std::string Bind(const std::string& endpoint);
  void Close();
  void* get() { return sock_; }

  // Receives one whole multipart message without blocking; false if none.
  bool RecvFrames(std::vector<Msg>* frames);
  // Sends frames without blocking; false (with errno in zmq_errno) if the
  // peer is unknown or the socket has no connection left (EAGAIN).
  bool SendFrames(std::vector<Msg>* frames);

 private:
  void* sock_;
};

// Whether libzmq holds a message to read on `socket` now (ZMQ_EVENTS).
// Asking takes in the commands its signal fd announced, which clears it.
bool SocketHasInput(void* socket);
// The fd libzmq signals when `socket` may have something new (ZMQ_FD):
// readable then, but a send or receive on the socket can take the signal
// in without a message being read. Throws Error if libzmq has none.
int SocketSignalFd(void* socket);

// An eventfd that makes a poll(2) return when another thread has work.
class Wakeup {
 public:
  Wakeup();
  ~Wakeup();
  void Notify();
  void Drain();
  int fd() const { return fd_; }

 private:
  int fd_;
  std::atomic<bool> pending_{false};  // written since the last Drain
};

// Checks Wakeup against lost wake-ups: one thread queues `items` (with
// short random pauses) and notifies after each; another polls the fd with
// `timeout_ms`, drains and takes what is queued, as the I/O loops do.
// Returns how many of its polls timed out while an item was queued (0 when
// no wake-up was lost).
long WakeupLostCount(long items, int timeout_ms);

}  // namespace bps

#endif  // BPS_TF_CORE_TRANSPORT_TRANSPORT_H_
