// The C ABI of bps_api.h over the C++ engine.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>

#include "bps_api.h"
#include "common/common.h"
#include "common/labels.h"
#include "common/stats.h"
#include "math/reduce.h"
#include "server/server_node.h"
#include "worker/local_reduce.h"
#include "worker/trace.h"
#include "worker/worker_engine.h"

static_assert(static_cast<int>(bps::LogLevel::kDebug) == BPS_LOG_DEBUG &&
                  static_cast<int>(bps::LogLevel::kInfo) == BPS_LOG_INFO &&
                  static_cast<int>(bps::LogLevel::kWarning) == BPS_LOG_WARNING &&
                  static_cast<int>(bps::LogLevel::kError) == BPS_LOG_ERROR,
              "bps_log_level and bps::LogLevel number the levels alike");

namespace {
bps::LogLevel LevelOf(int level) {
  return static_cast<bps::LogLevel>(level < BPS_LOG_DEBUG   ? BPS_LOG_DEBUG
                                    : level > BPS_LOG_ERROR ? BPS_LOG_ERROR
                                                            : level);
}

void CopyError(const std::string& message, char* err, size_t err_len) {
  if (!err || err_len == 0) return;
  std::strncpy(err, message.c_str(), err_len - 1);
  err[err_len - 1] = '\0';
}
}  // namespace

extern "C" {

int bps_worker_init(const char* config, char* err, size_t err_len) {
  try {
    bps::Config cfg = bps::Config::Parse(config ? config : "");
    bps::WorkerEngine::Get().Init(cfg);
    try {
      bps::LocalReduce::Get().Start(cfg);
    } catch (...) {
      bps::WorkerEngine::Get().Shutdown();
      throw;
    }
    return 0;
  } catch (const std::exception& e) {
    CopyError(e.what(), err, err_len);
    return -1;
  }
}

void bps_worker_shutdown(void) { bps_worker_leave(""); }

void bps_worker_leave(const char* reason) {
  bps::LocalReduce::Get().Stop();
  bps::WorkerEngine::Get().Shutdown(reason ? reason : "");
}
int bps_is_initialized(void) { return bps::WorkerEngine::Get().initialized() ? 1 : 0; }
int bps_rank(void) { return bps::WorkerEngine::Get().rank(); }
int bps_size(void) { return bps::WorkerEngine::Get().size(); }
int bps_local_rank(void) { return bps::WorkerEngine::Get().local_rank(); }
int bps_local_size(void) { return bps::WorkerEngine::Get().local_size(); }
int bps_cross_rank(void) { return bps::WorkerEngine::Get().cross_rank(); }
int bps_cross_size(void) { return bps::WorkerEngine::Get().cross_size(); }
int bps_is_homogeneous(void) { return bps::WorkerEngine::Get().homogeneous() ? 1 : 0; }

int bps_start_timeline(const char* path) {
  if (!bps_is_initialized()) return -1;
  return bps::Trace::Get().Start(path ? path : "") ? 0 : -2;
}

int bps_stop_timeline(char* path_out, size_t len) {
  std::string path;
  int code = bps::Trace::Get().Stop(&path);
  if (code != -1 && path_out && len) std::snprintf(path_out, len, "%s", path.c_str());
  return code;
}

void bps_enqueue_push_pull(const char* name, int dtype, const int64_t* shape, int ndim,
                           const void* in, void* out, int64_t priority, bps_done_fn done,
                           void* ctx) {
  std::vector<int64_t> dims(shape, shape + (ndim > 0 ? ndim : 0));
  try {
    bps::LocalReduce::Get().Enqueue(name ? name : "", dtype, dims, in, out, priority, done, ctx,
                                    "", "");
  } catch (const std::exception& e) {
    done(ctx, BPS_ERR_INTERNAL, e.what());
  }
}

void bps_enqueue_reduce(const char* name, int dtype, const int64_t* shape, int ndim,
                        const void* in, void* out, int64_t priority, int reduce_op,
                        const char* agreement, bps_done_fn done, void* ctx) {
  std::vector<int64_t> dims(shape, shape + (ndim > 0 ? ndim : 0));
  try {
    bps::WorkerEngine::Get().Enqueue(name ? name : "", dtype, dims, in, out, priority, done, ctx,
                                     "", agreement ? agreement : "", reduce_op);
  } catch (const std::exception& e) {
    done(ctx, BPS_ERR_INTERNAL, e.what());
  }
}

void bps_enqueue_push_pull_ex(const char* name, int dtype, const int64_t* shape, int ndim,
                              const void* in, void* out, int64_t priority,
                              const char* compression, const char* agreement,
                              bps_done_fn done, void* ctx) {
  std::vector<int64_t> dims(shape, shape + (ndim > 0 ? ndim : 0));
  try {
    bps::LocalReduce::Get().Enqueue(name ? name : "", dtype, dims, in, out, priority, done, ctx,
                                    compression ? compression : "", agreement ? agreement : "");
  } catch (const std::exception& e) {
    done(ctx, BPS_ERR_INTERNAL, e.what());
  }
}

void bps_set_tensor_label(const char* name, const char* label) {
  bps::TensorLabels::Get().Set(name ? name : "", label ? label : "");
}

void bps_set_activity(const char* text) { bps::TensorLabels::Get().SetActivity(text ? text : ""); }

void bps_trace_wait(const char* name, int64_t begin_ns, int64_t end_ns) {
  using bps::Clock;
  auto at = [](int64_t ns) { return Clock::time_point(std::chrono::nanoseconds(ns)); };
  bps::Trace::Get().RecordWait(name ? name : "", at(begin_ns), at(end_ns));
}

int bps_join(char* err, size_t err_len) {
  try {
    // Every rank refuses alike (the setting agrees on every node), so none
    // waits for a join the others never make.
    if (bps::LocalReduce::Get().active()) {
      throw bps::Error(
          "join is not available with local reduce; set BYTEPS_LOCAL_REDUCE=0");
    }
    return bps::WorkerEngine::Get().Join();
  } catch (const std::exception& e) {
    if (err && err_len) {
      std::snprintf(err, err_len, "%s", e.what());
    }
    return -1;
  }
}

void bps_refuse_when_joined(const char* name) {
  bps::WorkerEngine::Get().RefuseWhenJoined(name ? name : "");
}

void bps_debug_pause_sends(int paused) { bps::WorkerEngine::Get().PauseSends(paused != 0); }

int bps_server_run(const char* config, char* err, size_t err_len) {
  std::string error;
  int code = bps::RunServerNode(bps::Config::Parse(config ? config : ""), &error);
  if (code != 0) CopyError(error, err, err_len);
  return code;
}

size_t bps_stats_json(char* buf, size_t len) {
  std::string json = bps::Stats::Get().Json();
  if (buf && len > 0) CopyError(json, buf, len);
  return json.size() + 1;
}

int bps_elastic_request_leave(void) { return bps::WorkerEngine::Get().RequestLeave() ? 1 : 0; }

int bps_log_enabled(int level) { return bps::LogEnabled(LevelOf(level)) ? 1 : 0; }

void bps_log(int level, const char* text) { bps::LogLine(LevelOf(level), text ? text : ""); }

uint64_t bps_fnv1a64(const void* data, size_t len) {
  return bps::Fnv1a64(std::string(static_cast<const char*>(data), data ? len : 0));
}

size_t bps_json_quote(const char* text, size_t text_len, char* buf, size_t len) {
  std::string quoted = bps::JsonString(std::string(text ? text : "", text ? text_len : 0));
  if (buf && len > 0) {
    size_t n = std::min(len - 1, quoted.size());
    std::memcpy(buf, quoted.data(), n);
    buf[n] = '\0';
  }
  return quoted.size() + 1;
}

void bps_sum_into(int dtype, void* dst, const void* src, size_t count) {
  bps::SumInto(dtype, dst, src, count);
}

}  // extern "C"
