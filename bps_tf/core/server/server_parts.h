// The server node's small parts (server_node.cc): a push's job from its
// header fields, the queue of replies the engine threads post, the ready
// file, the reply credit. Header-only, included by the server node alone
// (server_node_impl.h).
#ifndef BPS_TF_CORE_SERVER_SERVER_PARTS_H_
#define BPS_TF_CORE_SERVER_SERVER_PARTS_H_

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/common.h"
#include "server/sum_engine.h"
#include "transport/protocol.h"
#include "transport/transport.h"

namespace bps {
namespace server_parts {

// A push's job from its header fields, whether they came in a FrameHeader
// or a fused part's sub-header, so both make the same job.
inline PushJob JobOf(int sender, uint64_t key, uint64_t round, uint16_t dtype, uint64_t request_id,
              uint32_t contributors, uint64_t members, uint8_t reduce_op, Msg payload,
              bool compressed) {
  PushJob job{sender, key, round, static_cast<int>(dtype), (request_id & kPushAsync) != 0,
              std::move(payload), compressed};
  job.contributors = contributors;
  job.members = members;
  job.reduce_op = reduce_op;
  job.refuse_joined = (request_id & kPushRefuseJoined) != 0;
  job.priority = PushPriorityOf(request_id);
  return job;
}

// Replies produced by engine threads wait here until the I/O thread sends.
class ReplyQueue {
 public:
  void Post(std::vector<ServerReply>&& replies) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& r : replies) queue_.push_back(std::move(r));
    }
    wake_.Notify();
  }
  std::vector<ServerReply> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<ServerReply> out;
    out.swap(queue_);
    return out;
  }
  Wakeup& wake() { return wake_; }

 private:
  std::mutex mu_;
  std::vector<ServerReply> queue_;
  Wakeup wake_;
};

inline void FreeBuffer(void* data, void*) { delete[] static_cast<char*>(data); }

inline void WriteReadyFile(const std::string& path, int port) {
  std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) throw Error("cannot write " + tmp);
  std::fprintf(f, "%d\n", port);
  std::fclose(f);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw Error("cannot rename " + tmp);
}

// Reply bytes per worker that may wait in libzmq; default four partitions
// (enough to keep a link busy while a busy machine schedules the server's
// loop to hand over the next), -1 none.
inline uint64_t ReplyCredit(const Config& cfg) {
  int64_t credit = cfg.GetInt("server_credit_bytes", 0);
  if (credit < 0) return 0;
  if (credit > 0) return static_cast<uint64_t>(credit);
  return 4 * static_cast<uint64_t>(
                 std::max<int64_t>(cfg.GetInt("partition_bytes", kDefaultPartitionBytes), 1));
}

inline int PortOf(const std::string& endpoint) {
  size_t colon = endpoint.rfind(':');
  return colon == std::string::npos ? 0 : std::atoi(endpoint.c_str() + colon + 1);
}

}  // namespace server_parts
}  // namespace bps

#endif  // BPS_TF_CORE_SERVER_SERVER_PARTS_H_
