#include "common/labels.h"

namespace bps {

TensorLabels& TensorLabels::Get() {
  static TensorLabels* labels = new TensorLabels();  // never destroyed: used at exit
  return *labels;
}

void TensorLabels::Set(const std::string& key, const std::string& label) {
  std::lock_guard<std::mutex> lock(mu_);
  if (label.empty()) {
    labels_.erase(key);
  } else {
    labels_[key] = label;
  }
}

std::string TensorLabels::Of(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = labels_.find(key);
  return it == labels_.end() ? std::string() : it->second;
}

std::string TensorLabels::Annotate(const std::string& key, const std::string& message) const {
  std::string label = Of(key);
  if (label.empty() || message.find(label) != std::string::npos) return message;
  return message + " (variable " + label + ")";
}

}  // namespace bps
