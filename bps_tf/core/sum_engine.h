// The server's summation engine: partitions are bound to engine threads
// (each key to the least-loaded thread, by bytes), so one key is only ever
// touched by one thread and needs no lock. A round of a key completes when
// every worker has pushed it; then each worker gets one reply sharing the
// summed buffer, and the next round accumulates into a fresh buffer, so a
// fast worker's next push never disturbs a slow worker's pending reply.
// A key reduced on each host first is pushed by one worker per host: its
// header's `contributors` says how many pushes complete a round, and only
// those workers get a reply.
// An asynchronous key (protocol.h) has no rounds: each push is added to the
// stored value and answered at once with a copy of it.
#ifndef BPS_TF_CORE_SUM_ENGINE_H_
#define BPS_TF_CORE_SUM_ENGINE_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "compressor.h"
#include "transport.h"

namespace bps {

struct PushJob {
  int worker;
  uint64_t key;
  uint64_t round;
  int dtype;
  bool async;  // an asynchronous key (protocol.h kPushAsync)
  Msg payload;
  bool compressed = false;  // payload is a compressed float32 partition
  uint32_t contributors = 0;  // workers pushing each round (0: all; protocol.h)
};

struct ServerReply {
  int worker;
  FrameHeader header;
  Msg payload;
};

class SumEngine {
 public:
  using Post = std::function<void(std::vector<ServerReply>&&)>;
  SumEngine(int server_id, int num_workers, int threads, Post post);
  ~SumEngine();
  void Submit(PushJob&& job);  // called by the I/O thread only

 private:
  struct KeyState {
    int dtype = -1;
    bool async = false;
    size_t bytes = 0;
    uint64_t round = 0;
    int count = 0;
    uint32_t contributors = 0;  // as the first push said; every push must agree
    std::vector<bool> pushed;
    bool has_sum = false;
    Msg sum;
    uint64_t sum_ns = 0;  // time spent adding this round (reported to workers)
    std::deque<PushJob> early;  // pushes for the next round, kept in order
    // Compressed keys: the first push's description, the float32 sum and
    // the server's own error-feedback residual for its re-compression.
    bool compressed = false;
    CompressedHeader described{};
    CompressorSpec spec;
    std::vector<float> acc, scratch;
    CompressorState state;
  };
  struct Lane {
    std::thread thread;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<PushJob> queue;
    bool stop = false;
    std::unordered_map<uint64_t, KeyState> keys;
  };

  void Run(Lane* lane);
  void Process(Lane* lane, PushJob&& job, std::vector<ServerReply>* replies);
  ServerReply ErrorReply(int worker, uint64_t key, const std::string& why);
  // Checks a compressed push against its key's description; "" when valid.
  std::string CheckCompressed(KeyState& st, const PushJob& job);
  void AddCompressed(KeyState& st, const PushJob& job);
  Msg CompressSum(KeyState& st, uint64_t key);

  int server_id_;
  int num_workers_;
  Post post_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::unordered_map<uint64_t, size_t> lane_of_key_;
  std::vector<uint64_t> lane_bytes_;
};

}  // namespace bps

#endif  // BPS_TF_CORE_SUM_ENGINE_H_
