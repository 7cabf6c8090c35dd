#include "worker/trace.h"

#include <cstdio>
#include <sys/stat.h>

#include "common/labels.h"

namespace bps {

Trace& Trace::Get() {
  static Trace* trace = new Trace();
  return *trace;
}

void Trace::Configure(bool on, const std::string& dir, int rank, int64_t start_step,
                      int64_t end_step) {
  std::lock_guard<std::mutex> lock(mu_);
  on_ = on;
  dir_ = dir.empty() ? "." : dir;
  file_.clear();
  rank_ = rank;
  start_ = start_step;
  end_ = end_step < 0 ? INT64_MAX : end_step;
  SetOrigin();
  events_.clear();
  rows_.clear();
  waits_.clear();
}

void Trace::SetOrigin() {
  origin_ = Clock::now();
  origin_unix_us_ = std::chrono::duration_cast<std::chrono::microseconds>(
                        std::chrono::system_clock::now().time_since_epoch())
                        .count();
}

int64_t Trace::Us(Clock::time_point t) const {
  return std::chrono::duration_cast<std::chrono::microseconds>(t - origin_).count();
}

int Trace::Row(const std::string& label) {
  auto it = rows_.find(label);
  if (it != rows_.end()) return it->second;
  int id = static_cast<int>(rows_.size()) + 1;
  rows_[label] = id;
  return id;
}

// The row a person recognises: the variable's label with the key beside it.
static std::string ShownName(const std::string& name, const std::string& label) {
  return label.empty() ? name : label + " (" + name + ")";
}

void Trace::RecordWait(const std::string& name, Clock::time_point begin, Clock::time_point end) {
  if (!on_) return;
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t step = waits_[name]++;
  if (static_cast<int64_t>(step) < start_ || static_cast<int64_t>(step) > end_ || end < begin) return;
  std::string label = TensorLabels::Get().Of(name);
  events_.push_back({"wait", "overlap", Us(begin), Us(end) - Us(begin),
                     Row(ShownName(name, label)),
                     "{\"tensor_name\":" + JsonString(name) + ",\"step\":" +
                         std::to_string(step) + "}"});
}

void Trace::RecordOperation(const std::string& name, int64_t priority, uint64_t step,
                            uint64_t bytes,
                            Clock::time_point enqueued, Clock::time_point declared,
                            Clock::time_point finished, const std::vector<PartTimes>& parts) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string args = "{\"step\":" + std::to_string(step) + ",\"bytes\":" + std::to_string(bytes) +
                     ",\"partitions\":" + std::to_string(parts.size()) + "}";
  // The key is what workers match on; a label (the variable) is what a person
  // recognises, so it names the event and its rows when there is one.
  std::string label = TensorLabels::Get().Of(name);
  std::string op_args = "{\"tensor_name\":" + JsonString(name) + ",\"priority\":" +
                        std::to_string(priority) + "," +
                        (label.empty() ? "" : "\"variable\":" + JsonString(label) + ",") +
                        args.substr(1);
  std::string shown = ShownName(name, label);
  int row = Row(shown);
  events_.push_back({label.empty() ? name : label, "push_pull", Us(enqueued),
                     Us(finished) - Us(enqueued), row, op_args});
  if (declared > enqueued) {
    events_.push_back({"declare", "stage", Us(enqueued), Us(declared) - Us(enqueued), row, args});
  }
  auto add = [&](const char* stage, Clock::time_point a, Clock::time_point b, int tid,
                 const std::string& extra) {
    if (a == Clock::time_point{} || b < a) return;
    events_.push_back({stage, "stage", Us(a), Us(b) - Us(a), tid, extra});
  };
  for (size_t p = 0; p < parts.size(); ++p) {
    const PartTimes& t = parts[p];
    int tid = Row(shown + " / part " + std::to_string(p));
    std::string pa = "{\"step\":" + std::to_string(step) + ",\"partition\":" + std::to_string(p) + "}";
    add("queue", declared, t.sent, tid, pa);
    Clock::time_point pushed = t.released < t.replied ? t.released : t.replied;
    add("push", t.sent, pushed, tid, pa);
    add("server", pushed, t.replied, tid, pa);
    if (t.server_sum_us > 0 && t.replied != Clock::time_point{}) {
      // The server's summing time, drawn at the end of the server stage.
      int64_t end = Us(t.replied);
      int64_t begin = std::max(Us(pushed), end - static_cast<int64_t>(t.server_sum_us));
      events_.push_back({"server sum", "stage", begin, end - begin, tid, pa});
    }
    add("copy out", t.replied, t.copied, tid, pa);
  }
}

// Like `mkdir -p`: a trace folder below one that does not exist yet is what
// a user names most often (a run's own output folder).
static void MakeParents(const std::string& dir) {
  for (size_t slash = dir.find('/', 1); slash != std::string::npos;
       slash = dir.find('/', slash + 1)) {
    mkdir(dir.substr(0, slash).c_str(), 0755);
  }
  mkdir(dir.c_str(), 0755);
}

std::string Trace::Flush() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!on_) return "";
  std::string path;
  return WriteLocked(&path) ? path : "";
}

bool Trace::Start(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  if (on_) return false;
  file_ = path;
  start_ = 0;
  end_ = INT64_MAX;
  SetOrigin();
  events_.clear();
  rows_.clear();
  // waits_ keeps counting: a wait's step must stay its push_pull's round.
  on_ = true;
  return true;
}

int Trace::Stop(std::string* path) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!on_) return -1;
  bool written = WriteLocked(path);
  on_ = false;
  file_.clear();
  return written ? 0 : -2;
}

bool Trace::WriteLocked(std::string* out) {
  std::string& path = *out;
  path = file_;
  if (path.empty()) {
    MakeParents(dir_);
    path = dir_ + "/bps_trace_rank" + std::to_string(rank_) + ".json";
  } else if (path.find('/') != std::string::npos) {
    MakeParents(path.substr(0, path.rfind('/')));
  }
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    BPS_LOG(kWarning, "cannot write the timeline to " << path);
    return false;
  }
  std::fprintf(f, "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
  std::fprintf(f, "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"worker %d\"}}",
               rank_, rank_);
  for (const auto& r : rows_) {
    std::fprintf(f, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":%s}}",
                 rank_, r.second, JsonString(r.first).c_str());
  }
  for (const auto& e : events_) {
    std::fprintf(f,
                 ",\n{\"name\":%s,\"cat\":\"%s\",\"ph\":\"X\",\"ts\":%lld,\"dur\":%lld,\"pid\":%d,"
                 "\"tid\":%d,\"args\":%s}",
                 JsonString(e.name).c_str(), e.cat.c_str(), static_cast<long long>(e.ts),
                 static_cast<long long>(e.dur), rank_, e.tid, e.args.c_str());
  }
  // Where this process's zero lies, so several ranks' files can be put on
  // one time axis: the monotonic clock is shared by the processes of one
  // host, wall-clock time (approximately) by hosts.
  std::fprintf(f, "\n],\"otherData\":{\"rank\":%d,\"origin_monotonic_us\":%lld,"
               "\"origin_unix_us\":%lld}}\n",
               rank_,
               static_cast<long long>(std::chrono::duration_cast<std::chrono::microseconds>(
                   origin_.time_since_epoch()).count()),
               static_cast<long long>(origin_unix_us_));
  std::fclose(f);
  events_.clear();
  return true;
}

}  // namespace bps
