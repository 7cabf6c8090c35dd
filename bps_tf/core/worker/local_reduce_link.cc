#include "worker/local_reduce_link.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <thread>

#include "common/common.h"

namespace bps {

namespace {

struct Head {
  uint32_t kind;
  int32_t rank;
  int32_t status;
  int32_t dtype;
  uint64_t round;
  uint64_t bytes;
  uint64_t slot, slot_bytes;
  uint32_t name_len, sig_len, text_len;
  uint32_t has_fd;
};

constexpr size_t kMaxPacket = 1 << 16;
constexpr size_t kMaxText = 8192;

bool Transient() { return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR; }

socklen_t AbstractAddress(const std::string& name, struct sockaddr_un* addr) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  size_t len = std::min(name.size(), sizeof(addr->sun_path) - 2);
  std::memcpy(addr->sun_path + 1, name.data(), len);  // leading NUL: abstract
  return static_cast<socklen_t>(offsetof(struct sockaddr_un, sun_path) + 1 + len);
}

}  // namespace

SharedRegion::~SharedRegion() {
  if (data) munmap(data, std::max<uint64_t>(bytes, 1));
}

std::shared_ptr<SharedRegion> MapShared(int fd, uint64_t bytes) {
  void* p = mmap(nullptr, std::max<uint64_t>(bytes, 1), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw Error(std::string("local reduce: mmap: ") + std::strerror(errno));
  auto r = std::make_shared<SharedRegion>();
  r->data = static_cast<char*>(p);
  r->bytes = bytes;
  return r;
}

std::shared_ptr<SharedRegion> CreateShared(uint64_t bytes, int* fd) {
  *fd = memfd_create("bps_tf_local_reduce", MFD_CLOEXEC);
  if (*fd < 0 || ftruncate(*fd, static_cast<off_t>(std::max<uint64_t>(bytes, 1))) != 0) {
    std::string why = std::strerror(errno);
    if (*fd >= 0) close(*fd);
    *fd = -1;
    throw Error("local reduce: cannot create " + std::to_string(bytes) +
                " bytes of shared memory (memfd): " + why);
  }
  try {
    return MapShared(*fd, bytes);
  } catch (...) {
    close(*fd);
    *fd = -1;
    throw;
  }
}

LocalLink::~LocalLink() {
  for (Out& o : outbox_) {
    if (o.fd >= 0) close(o.fd);
  }
  close(fd_);
}

void LocalLink::Send(LocalPacket p) {
  Head h{};
  h.kind = static_cast<uint32_t>(p.kind);
  h.rank = p.rank;
  h.status = p.status;
  h.dtype = p.dtype;
  h.round = p.round;
  h.bytes = p.bytes;
  h.slot = p.slot;
  h.slot_bytes = p.slot_bytes;
  if (p.text.size() > kMaxText) p.text.resize(kMaxText);
  h.name_len = static_cast<uint32_t>(p.name.size());
  h.sig_len = static_cast<uint32_t>(p.sig.size());
  h.text_len = static_cast<uint32_t>(p.text.size());
  h.has_fd = p.fd >= 0 ? 1 : 0;
  outbox_.push_back(Out{std::string(reinterpret_cast<const char*>(&h), sizeof(h)) + p.name +
                            p.sig + p.text,
                        p.fd});
  Flush();
}

void LocalLink::Flush() {
  while (!outbox_.empty()) {
    Out& o = outbox_.front();
    struct iovec iov {
      const_cast<char*>(o.bytes.data()), o.bytes.size()
    };
    struct msghdr msg {};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    char control[CMSG_SPACE(sizeof(int))];
    if (o.fd >= 0) {
      std::memset(control, 0, sizeof(control));
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      struct cmsghdr* cm = CMSG_FIRSTHDR(&msg);
      cm->cmsg_level = SOL_SOCKET;
      cm->cmsg_type = SCM_RIGHTS;
      cm->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(cm), &o.fd, sizeof(int));
    }
    if (sendmsg(fd_, &msg, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
      if (Transient()) return;
      // The peer is gone: Receive() reports it on the next poll.
      for (Out& left : outbox_) {
        if (left.fd >= 0) close(left.fd);
      }
      outbox_.clear();
      return;
    }
    if (o.fd >= 0) close(o.fd);
    outbox_.pop_front();
  }
}

int LocalLink::Receive(LocalPacket* p) {
  std::string buf(kMaxPacket, '\0');
  struct iovec iov {
    &buf[0], buf.size()
  };
  struct msghdr msg {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  char control[CMSG_SPACE(sizeof(int))];
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n = recvmsg(fd_, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0 && Transient()) return 0;
  if (n <= 0) return -1;
  int fd = -1;
  for (struct cmsghdr* cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm)) {
    if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
      std::memcpy(&fd, CMSG_DATA(cm), sizeof(int));
    }
  }
  Head h;
  if (static_cast<size_t>(n) < sizeof(h) ||
      (std::memcpy(&h, buf.data(), sizeof(h)),
       sizeof(h) + uint64_t{h.name_len} + h.sig_len + h.text_len != static_cast<uint64_t>(n)) ||
      (h.has_fd != 0) != (fd >= 0)) {
    if (fd >= 0) close(fd);
    return -1;
  }
  p->kind = static_cast<LocalKind>(h.kind);
  p->rank = h.rank;
  p->status = h.status;
  p->dtype = h.dtype;
  p->round = h.round;
  p->bytes = h.bytes;
  p->slot = h.slot;
  p->slot_bytes = h.slot_bytes;
  p->name = buf.substr(sizeof(h), h.name_len);
  p->sig = buf.substr(sizeof(h) + h.name_len, h.sig_len);
  p->text = buf.substr(sizeof(h) + h.name_len + h.sig_len, h.text_len);
  p->fd = fd;
  return 1;
}

int ListenLocal(const std::string& name) {
  struct sockaddr_un addr;
  socklen_t len = AbstractAddress(name, &addr);
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  // Every other worker of the host connects at once (the kernel caps it).
  if (fd < 0 || bind(fd, reinterpret_cast<struct sockaddr*>(&addr), len) != 0 ||
      listen(fd, SOMAXCONN) != 0) {
    std::string why = std::strerror(errno);
    if (fd >= 0) close(fd);
    throw Error("local reduce: cannot listen for this host's workers: " + why);
  }
  return fd;
}

int ConnectLocal(const std::string& name, double timeout_s, const std::string& whom) {
  struct sockaddr_un addr;
  socklen_t len = AbstractAddress(name, &addr);
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(std::string("local reduce: socket: ") + std::strerror(errno));
  auto begin = Clock::now();
  // The root opens its socket right after joining, as this worker does.
  while (connect(fd, reinterpret_cast<struct sockaddr*>(&addr), len) != 0) {
    if (SecondsSince(begin) > timeout_s) {
      std::string why = std::strerror(errno);
      close(fd);
      throw Error("local reduce: " + whom + " did not open its local-reduce socket within " +
                  std::to_string(static_cast<int>(timeout_s)) + " s (" + why +
                  "); set BYTEPS_LOCAL_REDUCE=0 to push from every worker");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return fd;
}

int AcceptLocal(int listen_fd) {
  int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) return -1;
  struct ucred cred {};
  socklen_t len = sizeof(cred);
  // Only this user's processes may read or feed the host's sums.
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != getuid()) {
    close(fd);
    return -1;
  }
  return fd;
}

}  // namespace bps
