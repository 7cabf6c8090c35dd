#include "common/common.h"

#include <pthread.h>
#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <mutex>

namespace bps {

namespace {
std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '%') out += "%25";
    else if (c == '\n') out += "%0A";
    else out += c;
  }
  return out;
}

std::string Unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size()) {
      std::string hex = s.substr(i + 1, 2);
      if (hex == "25") { out += '%'; i += 2; continue; }
      if (hex == "0A") { out += '\n'; i += 2; continue; }
    }
    out += s[i];
  }
  return out;
}
}  // namespace

Config Config::Parse(const std::string& text) {
  Config cfg;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    cfg.values_[line.substr(0, eq)] = Unescape(line.substr(eq + 1));
  }
  return cfg;
}

std::string Config::Serialize() const {
  std::string out;
  for (const auto& kv : values_) out += kv.first + "=" + Escape(kv.second) + "\n";
  return out;
}

std::string Config::Get(const std::string& key, const std::string& dflt) const {
  auto it = values_.find(key);
  return it == values_.end() ? dflt : it->second;
}

int64_t Config::GetInt(const std::string& key, int64_t dflt) const {
  auto it = values_.find(key);
  if (it == values_.end() || it->second.empty()) return dflt;
  try {
    size_t used = 0;
    int64_t v = std::stoll(it->second, &used, 0);
    if (used != it->second.size()) throw std::invalid_argument("trailing");
    return v;
  } catch (const std::exception&) {
    throw Error("setting '" + key + "' must be an integer, got '" + it->second + "'");
  }
}

double Config::GetDouble(const std::string& key, double dflt) const {
  auto it = values_.find(key);
  if (it == values_.end() || it->second.empty()) return dflt;
  try {
    return std::stod(it->second);
  } catch (const std::exception&) {
    throw Error("setting '" + key + "' must be a number, got '" + it->second + "'");
  }
}

namespace {
std::mutex g_log_mu;
std::string g_log_who = "bps_tf";
std::atomic<int> g_log_level{static_cast<int>(LogLevel::kWarning)};
}  // namespace

void SetLogIdentity(const std::string& who) {
  std::lock_guard<std::mutex> lock(g_log_mu);
  g_log_who = who;
}

void SetLogLevel(const std::string& level) {
  std::string l;
  for (char c : level) l += static_cast<char>(toupper(c));
  LogLevel v = LogLevel::kWarning;
  if (l == "DEBUG" || l == "TRACE") v = LogLevel::kDebug;
  else if (l == "INFO") v = LogLevel::kInfo;
  else if (l == "ERROR" || l == "FATAL") v = LogLevel::kError;
  g_log_level = static_cast<int>(v);
}

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_log_level; }

void LogLine(LogLevel level, const std::string& text) {
  static const char* kNames[] = {"DEBUG", "INFO", "WARNING", "ERROR"};
  char stamp[32];
  std::time_t now = std::time(nullptr);
  std::tm tm_now;
  localtime_r(&now, &tm_now);
  std::strftime(stamp, sizeof(stamp), "%H:%M:%S", &tm_now);
  std::lock_guard<std::mutex> lock(g_log_mu);
  std::fprintf(stderr, "[%s %s bps_tf %s] %s\n", stamp, kNames[static_cast<int>(level)],
               g_log_who.c_str(), text.c_str());
  std::fflush(stderr);
}

int DTypeFromName(const std::string& name) {
  for (const DTypeInfo& d : kDTypes) {
    if (name == d.name) return d.code;
  }
  return -1;
}

std::string DTypeNameList() {
  std::string out;
  for (const DTypeInfo& d : kDTypes) out += std::string(out.empty() ? "" : ", ") + d.name;
  return out;
}

std::string ShapeString(int dtype, const std::vector<int64_t>& shape) {
  std::string s = std::string(DTypeName(dtype)) + "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

uint64_t Fnv1a64(const std::string& text) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

void NameThisThread(const char* name) {
#ifdef __linux__
  pthread_setname_np(pthread_self(), name);  // best effort: only a label
#else
  (void)name;
#endif
}

bool KeepFreedBuffersInHeap() {
#ifdef __GLIBC__
  // Every message's buffer (up to a partition, 1 MiB by default) is malloc'd
  // by a ZeroMQ I/O thread and freed after use. Above glibc's mmap threshold,
  // or once the heap's free top passes the trim threshold, the pages go back
  // to the kernel and the next message faults in and zeroes fresh ones: a
  // quarter of a 64 MiB push_pull's time on loopback. 32 MiB is the largest
  // threshold mallopt accepts.
  static const bool done = mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 &&
                           mallopt(M_TRIM_THRESHOLD, 512 << 20) == 1;
  return done;
#else
  return false;
#endif
}

}  // namespace bps
