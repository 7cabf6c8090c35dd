#include "common/stats.h"

#include "common/common.h"

#include <cstdio>
#include <sstream>

namespace bps {

Stats& Stats::Get() {
  static Stats* stats = new Stats();  // never destroyed: threads may outlive exit
  return *stats;
}

void Stats::RecordSend(const std::string& name, uint32_t part, int64_t priority) {
  std::lock_guard<std::mutex> lock(mu_);
  if (send_log_.size() < 100000) send_log_.push_back(SendRecord{name, part, priority});
}

void Stats::ClearSendLog() {
  std::lock_guard<std::mutex> lock(mu_);
  send_log_.clear();
}

void Stats::AddHostUpdate(uint64_t seq, int64_t time_ms, int flags) {
  std::lock_guard<std::mutex> lock(mu_);
  if (host_updates_.size() >= 64) host_updates_.erase(host_updates_.begin());
  host_updates_.push_back(HostUpdate{seq, time_ms, flags});
}

void Stats::SetElasticLeave(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  elastic_leave_ = why;
}

void Stats::ClearElastic() {
  std::lock_guard<std::mutex> lock(mu_);
  host_updates_.clear();
  elastic_leave_.clear();
}


std::string Stats::Json() {
  std::ostringstream o;
  o << "{\"bytes_sent\":" << bytes_sent << ",\"bytes_received\":" << bytes_received
    << ",\"frames_dropped\":" << frames_dropped
    << ",\"frames_foreign_release\":" << frames_foreign_release
    << ",\"connections_refused\":" << connections_refused
    << ",\"frames_rejected\":" << frames_rejected
    << ",\"replies_decrypted_to_output\":" << replies_decrypted_to_output
    << ",\"messages_sealed_in_slices\":" << messages_sealed_in_slices
    << ",\"messages_sealed_shared\":" << messages_sealed_shared
    << ",\"messages_opened_shared\":" << messages_opened_shared
    << ",\"connections_capped\":" << connections_capped << ",\"links_local\":" << links_local
    << ",\"ops_done\":" << ops_done
    << ",\"ops_failed\":" << ops_failed << ",\"partitions_sent\":" << partitions_sent
    << ",\"fused_messages_sent\":" << fused_messages_sent
    << ",\"fused_messages_received\":" << fused_messages_received
    << ",\"pushes_received\":" << pushes_received
    << ",\"local_reduce_ops\":" << local_reduce_ops
    << ",\"join_seen_sent\":" << join_seen_sent
    << ",\"heap_keeps_buffers\":" << (heap_keeps_buffers ? "true" : "false")
    << ",\"node_state\":" << node_state
    << ",\"elastic_epoch\":" << elastic_epoch
    << ",\"elastic_announced\":" << elastic_announced
    << ",\"elastic_waiting\":" << elastic_waiting
    << ",\"frames_stale_epoch\":" << frames_stale_epoch
    << ",\"sweep_found_input\":" << sweep_found_input
    << ",\"elastic_updates\":[";
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < host_updates_.size(); ++i) {
    o << (i ? "," : "") << "[" << host_updates_[i].seq << "," << host_updates_[i].time_ms << ","
      << host_updates_[i].flags << "]";
  }
  o << "],\"elastic_leave\":" << JsonString(elastic_leave_) << ",\"send_log\":[";
  for (size_t i = 0; i < send_log_.size(); ++i) {
    if (i) o << ",";
    o << "[" << JsonString(send_log_[i].name) << "," << send_log_[i].part << ","
      << send_log_[i].priority << "]";
  }
  o << "]}";
  return o.str();
}

}  // namespace bps
