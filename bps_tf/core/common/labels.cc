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

std::string TensorLabels::QuotedLabels(const std::string& message) const {
  std::string out;
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t open = message.find('\''); open != std::string::npos;) {
    size_t close = message.find('\'', open + 1);
    if (close == std::string::npos) break;
    auto it = labels_.find(message.substr(open + 1, close - open - 1));
    if (it != labels_.end()) {
      out += (out.empty() ? "; " : ", ") + message.substr(open, close - open + 1) +
             " is variable " + it->second;
    }
    open = message.find('\'', close + 1);
  }
  return out;
}

void TensorLabels::SetActivity(const std::string& text) {
  std::lock_guard<std::mutex> lock(mu_);
  activity_ = text;
}

std::string TensorLabels::Activity() const {
  std::lock_guard<std::mutex> lock(mu_);
  return activity_;
}

std::string TensorLabels::WhileDoing() const {
  std::string activity = Activity();
  return activity.empty() ? std::string() : " while this worker is in " + activity;
}

}  // namespace bps
