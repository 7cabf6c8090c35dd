// Names a person recognises for tensor keys.
//
// The key of a push_pull made by BytePSStrategy is a stable name that every
// worker derives the same way (bps_tf/comm/naming.py), not the variable it
// carries. The Python side tells the core which variable that is, so error
// messages, logs and the timeline can say "dense_1/kernel" as well. Labels
// never travel and never take part in matching tensors across workers.
//
// The same goes for what the worker's program is doing ("fit, epoch 4 of
// 10"): the Python side says so at each Keras phase boundary, so a stall
// warning can say where this worker was, not only which key waits.
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
  // The labels of the keys `message` quotes ('key'), as "; 'key' is variable
  // label, ..."; "" when none has one. For messages written where labels
  // are unknown (the scheduler's).
  std::string QuotedLabels(const std::string& message) const;

  // What this worker is doing, as the program last said ("" when unknown).
  void SetActivity(const std::string& text);
  std::string Activity() const;
  // " while this worker is in <activity>" when one is known, else "".
  std::string WhileDoing() const;

 private:
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::string> labels_;
  std::string activity_;
};

}  // namespace bps

#endif  // BPS_TF_CORE_COMMON_LABELS_H_
