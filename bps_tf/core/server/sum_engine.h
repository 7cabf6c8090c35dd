// The server's summation engine: partitions are bound to engine threads
// (each key to the least-loaded thread, by bytes; keys under 64 KiB to the
// I/O thread itself, at Flush, since waking a thread costs more than their
// sum), so one key is only ever touched by one thread and needs no lock. A round of a key completes when
// its contributors (every worker, or the members of a process set: the
// push header says how many) have pushed it; then each gets one reply sharing the
// summed buffer, and the next round accumulates into a fresh buffer, so a
// fast worker's next push never disturbs a slow worker's pending reply.
// A key reduced on each host first is pushed by one worker per host: its
// header's `contributors` says how many pushes complete a round, and only
// those workers get a reply.
// An asynchronous key (protocol.h) has no rounds: each push is added to the
// stored value and answered at once with a copy of it.
//
// Join: a worker's kJoin reaches every lane after that worker's earlier
// pushes (one connection, one queue per lane, in order). From then on it
// counts as having pushed zeros in every round of every key of the lane
// whose process set it belongs to (FrameHeader::members), until every
// worker has joined; the server then answers each worker's
// kJoin. A worker's rounds skipped that way are remembered per key, so its
// own round numbers (how often it pushed) still match after the join.
#ifndef BPS_TF_CORE_SERVER_SUM_ENGINE_H_
#define BPS_TF_CORE_SERVER_SUM_ENGINE_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "math/compressor.h"
#include "transport/link_cipher.h"
#include "transport/transport.h"

namespace bps {

struct PushJob {
  int worker;
  uint64_t key;
  uint64_t round;
  int dtype;
  bool async;  // an asynchronous key (protocol.h kPushAsync)
  Msg payload;
  bool compressed = false;  // payload is a compressed float32 partition
  uint32_t contributors = 0;  // FrameHeader::contributors: 0 = every worker
  uint64_t members = 0;       // FrameHeader::members: the process set's ranks as bits
  uint8_t reduce_op = 0;    // protocol.h ReduceOp
  bool refuse_joined = false;  // protocol.h kPushRefuseJoined
  bool join = false;        // not a push: the worker has joined (no payload)
  int32_t priority = 0;     // protocol.h PushPriorityOf
};

struct ServerReply {
  int worker;
  FrameHeader header;
  Msg payload;
  // The order replies to one worker leave in when they queue: a sum takes
  // its pushes' priority; errors go first, the all-joined notice last.
  int32_t priority = INT32_MAX;
  // Set when the payload goes to several workers (a round's sum): their
  // sends share one encryption on sealed links (channel.h SendShared).
  std::shared_ptr<SharedSealSlot> shared;
};

class SumEngine {
 public:
  using Post = std::function<void(std::vector<ServerReply>&&)>;
  SumEngine(int server_id, int num_workers, int threads, Post post);
  ~SumEngine();
  // Called by the I/O thread only. A push of a small key (under 64 KiB and
  // not compressed) waits for the next Flush(), which sums every such push
  // queued since on the calling thread: handing it to a summing thread
  // would cost a context switch each way, far more than the sum (most of a
  // small push's cost on the server). A large key's push wakes its summing
  // thread at once, so summing overlaps with receiving the next.
  void Submit(PushJob&& job);
  void SubmitJoin(int worker);  // every lane sees it, after the worker's pushes
  void Flush();

 private:
  struct KeyState {
    int dtype = -1;
    uint8_t reduce_op = 0;  // the first push's; every later push must match
    bool refuse_joined = false;
    std::vector<uint64_t> skipped;  // per worker: rounds completed while it had joined
    bool async = false;
    size_t bytes = 0;
    uint64_t round = 0;
    int count = 0;
    int32_t priority = 0;       // the highest of this round's pushes
    uint32_t contributors = 0;  // as the first push declared it
    uint64_t members = 0;       // as the first push declared it (0: unknown or every worker)
    int needed = 0;             // pushes that complete a round
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
    std::vector<bool> joined;  // per worker, until every worker has joined
    int joined_count = 0;
  };

  // Whether `worker` takes part in the key (true when the set is unknown).
  static bool IsMember(const KeyState& st, int worker);
  void Run(Lane* lane);
  void Queue(Lane* lane, PushJob&& job);  // and wakes its summing thread, if it has one
  void Process(Lane* lane, PushJob&& job, std::vector<ServerReply>* replies);
  // Process's steps. The first push of a key describes it; a push that does
  // not agree with that description (who takes part, async, reduce op) or
  // does not fit it (dtype, size, compression) is refused; an asynchronous
  // key is answered at once; a push of a joined worker, of a round not open
  // yet (kept in `early`) or made twice takes no part; Accumulate adds it.
  // Each returns false (or nothing) once it has answered or kept the push.
  void AdoptFirstPush(KeyState& st, const PushJob& job);
  bool Agrees(const KeyState& st, const PushJob& job, std::vector<ServerReply>* replies);
  bool Fits(KeyState& st, const PushJob& job, std::vector<ServerReply>* replies);
  void AnswerAsync(KeyState& st, const PushJob& job, size_t count,
                   std::vector<ServerReply>* replies);
  bool TakesPart(Lane* lane, KeyState& st, PushJob& job, std::vector<ServerReply>* replies);
  bool Accumulate(KeyState& st, PushJob& job, size_t count, std::vector<ServerReply>* replies);
  ServerReply ErrorReply(int worker, uint64_t key, const std::string& why);
  void OnJoin(Lane* lane, int worker, std::vector<ServerReply>* replies);
  // Ends the key's round when every worker pushed it or has joined.
  void MaybeComplete(Lane* lane, uint64_t key, KeyState& st, std::vector<ServerReply>* replies);
  // The round's replies: the sum (or `refused`) to each worker that pushed.
  void ReplyRound(uint64_t key, KeyState& st, const std::string& refused, uint64_t joined_mask,
                  std::vector<ServerReply>* replies);
  // Opens the next round and processes the pushes that came early for it.
  void NextRound(Lane* lane, KeyState& st, std::vector<ServerReply>* replies);
  // Checks a compressed push against its key's description; "" when valid.
  std::string CheckCompressed(KeyState& st, const PushJob& job);
  void AddCompressed(KeyState& st, const PushJob& job);
  Msg CompressSum(KeyState& st, uint64_t key);

  int server_id_;
  int num_workers_;
  Post post_;
  // One per summing thread, then the small keys' lane (no thread: Flush).
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::unordered_map<uint64_t, size_t> lane_of_key_;
  std::vector<uint64_t> lane_bytes_;
  std::atomic<int> join_lanes_left_{0};  // lanes yet to see every worker's join
};

}  // namespace bps

#endif  // BPS_TF_CORE_SERVER_SUM_ENGINE_H_
