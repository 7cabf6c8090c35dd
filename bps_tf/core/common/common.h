// Small shared pieces of the core: configuration text, logging, data types,
// clocks. No TensorFlow, no ZeroMQ.
#ifndef BPS_TF_CORE_COMMON_COMMON_H_
#define BPS_TF_CORE_COMMON_COMMON_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtypes.h"

namespace bps {

// Raised for configuration and protocol problems that end an operation;
// the message is meant for the user.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// "key=value\n" text, as built by bps_tf/runtime/config.py.
class Config {
 public:
  static Config Parse(const std::string& text);
  std::string Get(const std::string& key, const std::string& dflt = "") const;
  int64_t GetInt(const std::string& key, int64_t dflt) const;
  double GetDouble(const std::string& key, double dflt) const;
  bool Has(const std::string& key) const { return values_.count(key) != 0; }
  void Set(const std::string& key, const std::string& value) {
    values_[key] = value;
  }
  std::string Serialize() const;
  const std::map<std::string, std::string>& values() const { return values_; }

 private:
  std::map<std::string, std::string> values_;
};

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };
void SetLogIdentity(const std::string& who);  // e.g. "worker 1"
void SetLogLevel(const std::string& level);
bool LogEnabled(LogLevel level);
void LogLine(LogLevel level, const std::string& text);

#define BPS_LOG(level, expr)                                    \
  do {                                                          \
    if (::bps::LogEnabled(::bps::LogLevel::level)) {            \
      std::ostringstream bps_log_stream_;                       \
      bps_log_stream_ << expr;                                  \
      ::bps::LogLine(::bps::LogLevel::level, bps_log_stream_.str()); \
    }                                                           \
  } while (0)

// -1 for a dtype name (numpy's) the core does not carry.
int DTypeFromName(const std::string& name);
// "float16, bfloat16, ...": for messages that say what is supported.
std::string DTypeNameList();

std::string ShapeString(int dtype, const std::vector<int64_t>& shape);
uint64_t Fnv1a64(const std::string& text);
std::string JsonString(const std::string& text);  // quoted and escaped

// BYTEPS_MALLOC_KEEP_BUFFERS: once per process, keeps freed buffers of up
// to 32 MiB in glibc's heap. Returns whether glibc took both settings.
bool KeepFreedBuffersInHeap();

// Names the calling thread (up to 15 characters: "bps-io", "bps-sum"), so
// that top -H, perf and gdb tell the engine's threads from the program's.
void NameThisThread(const char* name);

using Clock = std::chrono::steady_clock;
inline double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace bps

#endif  // BPS_TF_CORE_COMMON_COMMON_H_
