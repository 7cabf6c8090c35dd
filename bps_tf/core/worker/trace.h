// Timeline: Chrome-trace / Perfetto JSON of where each push_pull's time
// goes, one file per worker (BYTEPS_TRACE_ON=1, BYTEPS_TRACE_DIR).
//
// Layout: one thread row per tensor name holds the whole operation; one row
// per partition of it holds that partition's stages in order (queue wait,
// push, server (with the server's own sum time nested at its end), copy
// out). Steps are counted per tensor (its round): only rounds in
// [BYTEPS_TRACE_START_STEP, BYTEPS_TRACE_END_STEP] are recorded.
#ifndef BPS_TF_CORE_WORKER_TRACE_H_
#define BPS_TF_CORE_WORKER_TRACE_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/common.h"

namespace bps {

struct PartTimes {
  Clock::time_point sent{}, released{}, replied{}, copied{};
  uint64_t server_sum_us = 0;
};

class Trace {
 public:
  static Trace& Get();
  void Configure(bool on, const std::string& dir, int rank, int64_t start_step, int64_t end_step);
  bool Wants(uint64_t step) const {
    return on_ && static_cast<int64_t>(step) >= start_ && static_cast<int64_t>(step) <= end_;
  }
  // The push_pull slice's args carry the tensor name and the priority the
  // kernel received (what the graph's priority pass decided).
  void RecordOperation(const std::string& name, int64_t priority, uint64_t step, uint64_t bytes,
                       Clock::time_point enqueued, Clock::time_point declared,
                       Clock::time_point finished, const std::vector<PartTimes>& parts);
  // A split push_pull's wait (ops/overlap_ops.cc): from the moment the
  // layer asked for its summed gradient to the moment it got it, on the
  // tensor's row. The k-th delivered wait of a tensor is its step k (it
  // takes step k's sum), so the same step range selects it.
  void RecordWait(const std::string& name, Clock::time_point begin, Clock::time_point end);
  // Writes <dir>/bps_trace_rank<r>.json (or Start's file); returns the path
  // ("" if off).
  std::string Flush();
  // Horovod's start_timeline: records every step from now on into `path`,
  // written by Stop (or at shutdown). False if a timeline records already.
  bool Start(const std::string& path);
  // Writes the timeline into *path and stops recording: 0, -1 if none was
  // recording, -2 if the file could not be written (*path names it).
  int Stop(std::string* path);

 private:
  struct Event {
    std::string name;
    std::string cat;
    int64_t ts, dur;
    int tid;
    std::string args;
  };
  int64_t Us(Clock::time_point t) const;
  void SetOrigin();
  int Row(const std::string& label);
  bool WriteLocked(std::string* path);  // false: *path could not be opened

  std::atomic<bool> on_{false};  // read without the lock by Wants()
  std::string dir_;
  std::string file_;  // Start's path; empty: <dir_>/bps_trace_rank<r>.json
  int rank_ = 0;
  int64_t start_ = 0, end_ = -1;
  Clock::time_point origin_ = Clock::now();
  int64_t origin_unix_us_ = 0;
  std::mutex mu_;
  std::vector<Event> events_;
  std::map<std::string, int> rows_;
  std::map<std::string, uint64_t> waits_;  // delivered waits per tensor name
};

}  // namespace bps

#endif  // BPS_TF_CORE_WORKER_TRACE_H_
