// The wire protocol between workers, servers and the scheduler.
//
// Every message is [header][payload] as two ZeroMQ frames (a ROUTER socket
// sees the sender's routing id in front). The header is a fixed 64-byte
// little-endian struct; control payloads are "key=value" text, data payloads
// are raw tensor bytes. Anything that does not parse is dropped and counted.
// Who may send frames at all is settled per connection, before any frame
// passes, by the link's security (security.h): headers carry no secret.
#ifndef BPS_TF_CORE_TRANSPORT_PROTOCOL_H_
#define BPS_TF_CORE_TRANSPORT_PROTOCOL_H_

#include <cstdint>
#include <string>

namespace bps {

constexpr uint32_t kMagic = 0x31535042;  // "BPS1"
// 2: the header's last 16 bytes are reserved (zero) instead of a MAC.
// 3: a push says how many workers contribute to its key (and which ones) and how
//    to reduce it; fused pushes and replies.
// 4: a push's request_id carries its priority in its high 32 bits.
// 5: a membership epoch in every worker -> server message (elastic training).
constexpr uint16_t kProtocolVersion = 5;

enum class MsgType : uint16_t {
  kHello = 1,          // node -> scheduler: who I am, my settings
  kWelcome = 2,        // scheduler -> node: the cluster layout
  kBarrier = 3,        // node -> scheduler
  kBarrierDone = 4,    // scheduler -> node
  kDeclare = 5,        // worker -> scheduler: a tensor's name and signature
  kDeclared = 6,       // scheduler -> worker: its key and servers, or an error
  kPush = 7,           // worker -> server: one partition
  kPullReply = 8,      // server -> worker: the summed partition
  kHeartbeat = 9,      // node -> scheduler
  kHeartbeatAck = 10,  // scheduler -> node
  kBye = 11,           // worker -> scheduler: leaving normally
  kShutdown = 12,      // scheduler -> server: every worker has left
  kError = 13,         // fatal (key 0) or about one partition (key != 0)
  kPeerLeft = 14,      // scheduler -> worker: another worker shut down;
                       // worker -> scheduler (elastic): it cannot reach a server ("server=")
  kStall = 15,         // scheduler -> worker: tensors some workers never declared (a warning)
  kPushCompressed = 16,  // worker -> server: one partition, compressed (compressor.h);
                         // the server's kPullReply carries the compressed sum
  kJoin = 17,            // worker -> each server, after its pushes: it has joined;
                         // server -> worker: every worker has joined at this server
  kJoinNotice = 18,      // worker -> scheduler: it has joined;
                         // scheduler -> worker: every worker has joined ("last=<rank>")
  kPushFused = 19,       // worker -> server: several small partitions (fusion.h)
  kPullReplyFused = 20,  // server -> worker: several summed partitions (fusion.h)
  // Elastic training (docs/elastic.md):
  kWorkersChanged = 21,  // scheduler -> worker: the membership changes ("epoch=", "why=");
                         // every pending and later operation of this epoch fails
  kHostsUpdated = 22,    // scheduler -> worker: workers wait to join ("waiting=<n>")
  kEpoch = 23,           // scheduler -> server: start epoch "epoch=" with "num_workers=",
                         // dropping every round of the last one;
                         // server -> scheduler: done ("epoch=")
  kControl = 24,         // launcher <-> scheduler (elastic): what the launcher saw and did
                         // ("lost=", "remove=", "announce=" launch ids); what the scheduler
                         // formed ("epoch=", "members=", "left=", "finished=", "failed=")
  kLeave = 25,           // worker -> scheduler: leave at the next commit (SIGTERM);
                         // scheduler -> worker: leave ("why="): at the next commit, or now
                         // when it is not a member
};
constexpr uint16_t kMaxMsgType = 25;

// kLauncher: bpslaunch's link to the scheduler (scheduler_control.cc).
enum class Role : uint16_t { kWorker = 0, kServer = 1, kScheduler = 2, kLauncher = 3 };

#pragma pack(push, 1)
struct FrameHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t type;
  int32_t sender;        // worker rank or server id; -1 for the scheduler
  uint16_t sender_role;  // Role
  uint16_t dtype;
  uint64_t key;          // partition key (tensor key | part index)
  uint64_t round;        // how many times this worker pushed this key before
  uint64_t request_id;   // echoed in replies to a kDeclare
  uint64_t payload_bytes;
  uint32_t contributors;  // how many distinct workers push this key each round; 0 = every worker
  uint8_t reduce_op;      // kPush: 0 sum, 1 min, 2 max, 3 product (enum class ReduceOp)
  uint64_t members;       // kPush of a process set: bit r = rank r takes part; 0 = every worker,
                          // or a set with a rank above kMaxMaskRank (see sum_engine.h).
                          // kPullReply(Fused): the workers counted as joined in the round
                          // (contributors = their number), for the scheduler's join order
  uint16_t epoch;         // worker -> server: the membership epoch the sender belongs to
                          // (0 unless elastic); a server drops messages of another epoch
  uint8_t reserved[1];    // zero
};
#pragma pack(pop)
static_assert(sizeof(FrameHeader) == 64, "FrameHeader is 64 bytes on the wire");

FrameHeader MakeHeader(MsgType type, Role role, int32_t sender);

// Checks a received header against the size of its payload frame. Returns
// an empty string when valid, else why it is not.
std::string ValidateHeader(const void* data, size_t size, size_t payload_size);

const char* MsgTypeName(uint16_t type);
const char* RoleName(Role role);

// Settings every node must agree on; sent in each HELLO and compared by the
// scheduler, whose error names the variable that sets each. The variables
// are bps_tf/runtime/config.py's and bps_tf/runtime/cluster.py's; tests/test_core_tables.py
// holds this list to them.
struct SharedSetting {
  const char* key;  // in the core's config text
  const char* env;
};
constexpr SharedSetting kSharedSettings[] = {
    {"num_workers", "DMLC_NUM_WORKER"},
    {"num_servers", "DMLC_NUM_SERVER"},
    {"partition_bytes", "BYTEPS_PARTITION_BYTES (or BYTEPS_LINK_RATE, which sizes it)"},
    {"async", "BYTEPS_ENABLE_ASYNC"},
    // A node whose token or encryption differs fails its handshake before
    // its HELLO; this still catches nodes that both run without a token.
    {"encryption", "BYTEPS_ENCRYPTION"},
    {"overlap", "BYTEPS_OVERLAP"},
    {"min_compress_bytes", "BYTEPS_MIN_COMPRESS_BYTES"},
    // Decides whether a host's workers push one sum or each their own.
    {"local_reduce", "BYTEPS_LOCAL_REDUCE"},
    // Elastic membership (docs/elastic.md): a fixed-size node among elastic
    // ones would take a membership change for a fatal loss, or the reverse.
    {"elastic", "BYTEPS_ELASTIC"},
};

// The goodbye reason of an elastic worker that leaves its membership to
// join the next epoch at once (bps_tf/runtime/elastic_core.py sends it): the
// scheduler starts a new epoch and expects it back, instead of counting it
// as a failure.
constexpr char kElasticRestart[] = "restarts its membership (elastic)";
// The goodbye reason of an elastic worker that leaves the job at a commit
// because it was asked to (its host was removed, or it got SIGTERM): a
// departure the others go on without, neither a failure nor the job's end.
constexpr char kElasticLeave[] = "leaves the job (elastic)";

// How a server combines the pushes of one round of a key (FrameHeader's
// reduce_op). Every push of a key must carry the same one.
enum class ReduceOp : uint8_t { kSum = 0, kMin = 1, kMax = 2, kProduct = 3 };
constexpr uint8_t kMaxReduceOp = 3;
// The highest rank FrameHeader::members can name.
constexpr int kMaxMaskRank = 63;
const char* ReduceOpName(uint8_t op);  // "sum", "min", ...; "unknown" past kMaxReduceOp

// Partition keys: the tensor key's low 16 bits hold the part index.
constexpr uint64_t kPartBits = 16;
constexpr uint64_t kMaxParts = 1ULL << kPartBits;
// BYTEPS_PARTITION_BYTES when the config text has none; bps_tf/runtime/config.py
// sends the same default, so this is only a fallback for direct core users.
constexpr int64_t kDefaultPartitionBytes = 1 << 20;
inline uint64_t PartKey(uint64_t tensor_key, uint64_t part) { return tensor_key | part; }
// The bytes of each partition (the last may be shorter) of a tensor whose
// elements are `elem` bytes: whole elements only, a partition never splits
// one. The scheduler places and counts partitions by it, workers cut by it.
inline uint64_t PartitionBytes(uint64_t partition_bytes, uint64_t elem) {
  elem = elem == 0 ? 1 : elem;
  const uint64_t whole = (partition_bytes / elem) * elem;
  return whole > elem ? whole : elem;
}

// Asynchronous keys (parameter-server training): the server holds the
// value, adds each push to it and answers that push at once with the value
// after the addition -- no rounds, no waiting for other workers. The tensor
// name says which keys are (bps_tf/comm/naming.py forms these names); a push
// carries it in its header's request_id, which pushes do not use otherwise,
// so one server serves synchronous and asynchronous keys side by side.
constexpr char kAsyncNamePrefix[] = "bps_async/";
constexpr uint64_t kPushAsync = 1;
// A push's request_id bit for a key that must not complete with a joined
// worker's contribution missing (broadcasts and allgathers, which Horovod
// refuses under join): its round fails instead, naming the joined workers.
constexpr uint64_t kPushRefuseJoined = 2;
// A push's request_id carries, in its high 32 bits, the partition's
// priority (int32, clamped): the server returns sums to each worker in
// this order when replies queue up, so an urgent sum overtakes bulk ones
// on the way back too.
inline uint64_t PushPriorityBits(int64_t priority) {
  int64_t p = priority < INT32_MIN ? INT32_MIN : priority > INT32_MAX ? INT32_MAX : priority;
  return static_cast<uint64_t>(static_cast<uint32_t>(static_cast<int32_t>(p))) << 32;
}
inline int32_t PushPriorityOf(uint64_t request_id) {
  return static_cast<int32_t>(static_cast<uint32_t>(request_id >> 32));
}
inline bool IsAsyncName(const std::string& name) {
  return name.compare(0, sizeof(kAsyncNamePrefix) - 1, kAsyncNamePrefix) == 0;
}

}  // namespace bps

#endif  // BPS_TF_CORE_TRANSPORT_PROTOCOL_H_
