// What local reduce (local_reduce.h) moves between the worker processes of
// one host: small packets over an abstract Unix seqpacket socket, which can
// carry a memfd descriptor, and the shared memory those descriptors map.
#ifndef BPS_TF_CORE_WORKER_LOCAL_REDUCE_LINK_H_
#define BPS_TF_CORE_WORKER_LOCAL_REDUCE_LINK_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>

namespace bps {

enum class LocalKind : uint32_t {
  kHello = 1,    // member -> root: my rank
  kContrib = 2,  // member -> root: my input for (name, round) is in my memfd `slot`
  kResult = 3,   // root -> member: the global sum is in your memfd (or an error)
};

struct LocalPacket {
  LocalKind kind = LocalKind::kHello;
  int32_t rank = 0;
  int32_t status = 0;
  int32_t dtype = 0;
  uint64_t round = 0;
  uint64_t bytes = 0;
  uint64_t slot = 0;        // kContrib: which of the member's memfds holds it
  uint64_t slot_bytes = 0;  // kContrib with fd: that memfd's size
  std::string name, sig, text;
  int fd = -1;  // a memfd travelling with the packet; the receiver owns it
};

// A MAP_SHARED mapping of a memfd, unmapped when the last owner lets go.
struct SharedRegion {
  char* data = nullptr;
  uint64_t bytes = 0;
  ~SharedRegion();
};
std::shared_ptr<SharedRegion> MapShared(int fd, uint64_t bytes);  // throws Error
// A new anonymous memfd of `bytes`, mapped; *fd keeps its descriptor open
// for sending. Throws Error.
std::shared_ptr<SharedRegion> CreateShared(uint64_t bytes, int* fd);

// One connection, non-blocking both ways: what the socket does not take at
// once waits in an outbox until it can be written.
class LocalLink {
 public:
  explicit LocalLink(int fd) : fd_(fd) {}
  ~LocalLink();
  LocalLink(const LocalLink&) = delete;
  LocalLink& operator=(const LocalLink&) = delete;
  int fd() const { return fd_; }
  bool want_write() const { return !outbox_.empty(); }
  void Send(LocalPacket p);  // takes p.fd
  void Flush();
  // 1: a packet is in *p; 0: nothing now; -1: closed, or a malformed packet.
  int Receive(LocalPacket* p);

 private:
  struct Out {
    std::string bytes;
    int fd;
  };
  int fd_;
  std::deque<Out> outbox_;
};

// The rendezvous of one host's workers: an abstract socket (no file; gone
// with its process; per network namespace). Each throws Error.
int ListenLocal(const std::string& name);
int ConnectLocal(const std::string& name, double timeout_s, const std::string& whom);
// A connection from a process of this user, else -1.
int AcceptLocal(int listen_fd);

}  // namespace bps

#endif  // BPS_TF_CORE_WORKER_LOCAL_REDUCE_LINK_H_
