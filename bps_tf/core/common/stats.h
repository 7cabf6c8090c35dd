// Process-wide counters, readable as JSON through bps_stats_json(); the
// send log records the order partitions left a worker (off by default).
#ifndef BPS_TF_CORE_COMMON_STATS_H_
#define BPS_TF_CORE_COMMON_STATS_H_

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace bps {

struct SendRecord {
  std::string name;
  uint32_t part;
  int64_t priority;
};

class Stats {
 public:
  static Stats& Get();
  std::atomic<uint64_t> bytes_sent{0};
  std::atomic<uint64_t> bytes_received{0};
  std::atomic<uint64_t> frames_dropped{0};
  // Of those, frames of another protocol version: a node of another release.
  std::atomic<uint64_t> frames_foreign_release{0};
  std::atomic<uint64_t> connections_refused{0};  // failed security handshakes
  // Sealed messages (BYTEPS_ENCRYPTION=1) of a peer with a verified
  // handshake that failed authentication, or came again or out of order.
  std::atomic<uint64_t> frames_rejected{0};
  // A worker's pull replies decrypted straight into the output (sealed
  // links: Channel::SetPayloadSink), with no copy after.
  std::atomic<uint64_t> replies_decrypted_to_output{0};
  // Messages sealed in several slices by several threads (cipher_pool.h).
  std::atomic<uint64_t> messages_sealed_in_slices{0};
  // Messages whose payload was encrypted once for several links (a server's
  // sum, link_cipher.h SharedSeal): sealed by this node, opened by it.
  std::atomic<uint64_t> messages_sealed_shared{0};
  std::atomic<uint64_t> messages_opened_shared{0};
  std::atomic<uint64_t> connections_capped{0};   // TCP connections given TCP_NOTSENT_LOWAT
  std::atomic<uint64_t> links_local{0};  // a worker's links to servers over Unix sockets
  std::atomic<uint64_t> ops_done{0};
  std::atomic<uint64_t> ops_failed{0};
  std::atomic<uint64_t> partitions_sent{0};
  // Messages carrying several partitions (fusion.h), sent and received.
  std::atomic<uint64_t> fused_messages_sent{0};
  std::atomic<uint64_t> fused_messages_received{0};
  std::atomic<uint64_t> pushes_received{0};     // a server's partitions in
  std::atomic<uint64_t> local_reduce_ops{0};    // ops summed with this host's peers
  // A worker's last JOIN_NOTICE: the workers its results had counted as
  // joined (bit r), which the scheduler uses to name the last to join.
  std::atomic<uint64_t> join_seen_sent{0};
  std::atomic<bool> heap_keeps_buffers{false};  // BYTEPS_MALLOC_KEEP_BUFFERS took effect
  std::atomic<bool> send_log_on{false};
  // A server or scheduler process: 0 starting, 1 the cluster has met,
  // 2 shutting down after a clean end, 3 failed (e.g. a lost peer).
  std::atomic<int> node_state{0};
  // Elastic training (docs/elastic.md). A worker: the membership epoch it
  // belongs to, the epoch the scheduler announced last (above the first
  // when the workers changed under it), and how many workers wait to join.
  // A server: pushes of another epoch it dropped.
  std::atomic<uint64_t> elastic_epoch{0};
  std::atomic<uint64_t> elastic_announced{0};
  std::atomic<uint64_t> elastic_waiting{0};
  std::atomic<uint64_t> frames_stale_epoch{0};
  // Input a channel's 100 ms sweep found before its signal fd showed it: input that came
  // after the poll returned, or a signal missed (transport/channel.cc).
  std::atomic<uint64_t> sweep_found_input{0};

  void RecordSend(const std::string& name, uint32_t part, int64_t priority);
  std::string Json();
  void ClearSendLog();
  // Elastic, a worker: the scheduler's host updates of this membership
  // (number, time in ms, flags: 1 removed, 2 added; the last 64), and why
  // it must leave the job ("" while it stays).
  void AddHostUpdate(uint64_t seq, int64_t time_ms, int flags);
  void SetElasticLeave(const std::string& why);
  void ClearElastic();

 private:
  struct HostUpdate {
    uint64_t seq;
    int64_t time_ms;
    int flags;
  };
  std::mutex mu_;
  std::vector<SendRecord> send_log_;
  std::vector<HostUpdate> host_updates_;
  std::string elastic_leave_;
};

}  // namespace bps

#endif  // BPS_TF_CORE_COMMON_STATS_H_
