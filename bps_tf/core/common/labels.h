// Names a person recognises for tensor keys.
//
// The key of a push_pull made by BytePSStrategy is a stable name that every
// worker derives the same way (bps_tf/comm/naming.py), not the variable it
// carries. The Python side tells the core which variable that is, so error
// messages, logs and the timeline can say "dense_1/kernel" as well. Labels
// never travel and never take part in matching tensors across workers.
#ifndef BPS_TF_CORE_COMMON_LABELS_H_
#define BPS_TF_CORE_COMMON_LABELS_H_

#include <mutex>
#include <string>
#include <unordered_map>

namespace bps {

class TensorLabels {
 public:
  static TensorLabels& Get();
  void Set(const std::string& key, const std::string& label);
  // The label of `key`, or "" when it has none.
  std::string Of(const std::string& key) const;
  // `message`, followed by " (variable <label>)" when `key` has a label the
  // message does not already mention.
  std::string Annotate(const std::string& key, const std::string& message) const;

 private:
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::string> labels_;
};

}  // namespace bps

#endif  // BPS_TF_CORE_COMMON_LABELS_H_
