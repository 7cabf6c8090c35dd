#include "priority_pass_stats.h"

#include <algorithm>
#include <cstring>

#include "bps_api.h"

namespace bps_tf {

namespace {
// The core's JSON quoting; 6 bytes per byte (a \u00XX escape) always suffice.
std::string JsonString(const std::string& text) {
  std::string out(6 * text.size() + 3, '\0');
  out.resize(bps_json_quote(text.data(), text.size(), &out[0], out.size()) - 1);
  return out;
}
}  // namespace

PassStats& PassStats::Get() {
  static PassStats* stats = new PassStats();
  return *stats;
}

void PassStats::Record(bool has_push_pull, int64_t nodes, int64_t ns) {
  std::lock_guard<std::mutex> lock(mu_);
  Cost& c = has_push_pull ? with_ : without_;
  c.graphs++;
  c.total_ns += ns;
  c.max_nodes = std::max(c.max_nodes, nodes);
  if (samples_.size() < 3 * 20000) {
    samples_.insert(samples_.end(), {has_push_pull ? 1 : 0, nodes, ns});
  }
  if (ns > c.max_ns) {
    c.max_ns = ns;
    c.max_ns_nodes = nodes;
  }
}

void PassStats::RecordDecisions(const std::vector<std::pair<std::string, int64_t>>& decided) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& d : decided) priorities_[d.first] = d.second;
}

void PassStats::Reset() {
  std::lock_guard<std::mutex> lock(mu_);
  without_ = Cost();
  with_ = Cost();
  priorities_.clear();
  samples_.clear();
}

std::string PassStats::Json() {
  std::lock_guard<std::mutex> lock(mu_);
  auto cost = [](const Cost& c) {
    return "{\"graphs\":" + std::to_string(c.graphs) + ",\"total_ns\":" +
           std::to_string(c.total_ns) + ",\"max_ns\":" + std::to_string(c.max_ns) +
           ",\"max_ns_nodes\":" + std::to_string(c.max_ns_nodes) + ",\"max_nodes\":" +
           std::to_string(c.max_nodes) + "}";
  };
  std::string out = "{\"without_push_pull\":" + cost(without_) +
                    ",\"with_push_pull\":" + cost(with_) + ",\"priorities\":{";
  bool first = true;
  for (const auto& p : priorities_) {
    out += (first ? "" : ",") + JsonString(p.first) + ":" + std::to_string(p.second);
    first = false;
  }
  out += "},\"samples\":[";
  for (size_t i = 0; i + 2 < samples_.size(); i += 3) {
    out += (i ? ",[" : "[") + std::to_string(samples_[i]) + "," +
           std::to_string(samples_[i + 1]) + "," + std::to_string(samples_[i + 2]) + "]";
  }
  return out + "]}";
}

}  // namespace bps_tf

extern "C" {

size_t bps_priority_pass_stats_json(char* buf, size_t len) {
  std::string json = bps_tf::PassStats::Get().Json();
  if (buf && len > 0) {
    size_t n = std::min(len - 1, json.size());
    std::memcpy(buf, json.data(), n);
    buf[n] = '\0';
  }
  return json.size() + 1;
}

void bps_priority_pass_stats_reset(void) { bps_tf::PassStats::Get().Reset(); }

}  // extern "C"
