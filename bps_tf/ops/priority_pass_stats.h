// What the priority pass did in this process: its cost per graph (with and
// without push_pull) and the last priority it decided for each tensor name.
// Read from Python through the C function below (ctypes on the op library):
// benchmarks/priority_pass_cost.py and the tests use it.
#ifndef BPS_TF_OPS_PRIORITY_PASS_STATS_H_
#define BPS_TF_OPS_PRIORITY_PASS_STATS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace bps_tf {

class PassStats {
 public:
  static PassStats& Get();
  void Record(bool has_push_pull, int64_t nodes, int64_t ns);
  void RecordDecisions(const std::vector<std::pair<std::string, int64_t>>& decided);
  std::string Json();
  void Reset();

 private:
  struct Cost {
    int64_t graphs = 0, total_ns = 0, max_ns = 0, max_nodes = 0, max_ns_nodes = 0;
  };
  std::mutex mu_;
  Cost without_, with_;
  // (has push_pull, nodes, ns) of the first graphs, for percentiles
  std::vector<int64_t> samples_;
  std::map<std::string, int64_t> priorities_;
};

}  // namespace bps_tf

extern "C" {
// JSON {"without_push_pull": {...}, "with_push_pull": {...}, "priorities": {...},
//       "samples": [[has_push_pull, nodes, ns], ...] (the first 20000 graphs)}
// into buf (truncated to len); returns the length it needs, terminator included.
size_t bps_priority_pass_stats_json(char* buf, size_t len);
void bps_priority_pass_stats_reset(void);
}

#endif  // BPS_TF_OPS_PRIORITY_PASS_STATS_H_
