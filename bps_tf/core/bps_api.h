// The whole contract of the bps_tf core, as a C ABI.
//
// The pybind11 module and the TensorFlow op library both link libbps_core.so
// and reach one engine per process through these functions. A C ABI keeps
// them independent of the C++ standard library ABI TensorFlow was built with.
#ifndef BPS_TF_CORE_BPS_API_H_
#define BPS_TF_CORE_BPS_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Element types; the values travel on the wire, never renumber them.
enum bps_dtype {
  BPS_FLOAT16 = 0,
  BPS_BFLOAT16 = 1,
  BPS_FLOAT32 = 2,
  BPS_FLOAT64 = 3,
  BPS_INT32 = 4,
  BPS_INT64 = 5,
};

// Why an operation failed. Callers choose their error type from the code
// (the TensorFlow kernels: the one named beside each), never from the text,
// which is for people and may change.
enum bps_status {
  BPS_OK = 0,
  BPS_ERR_NOT_INITIALIZED = 1,  // FailedPrecondition: init() has not run
  BPS_ERR_INVALID = 2,          // InvalidArgument: a dtype, shape, name or call
                                // the core refuses
  BPS_ERR_UNAVAILABLE = 3,      // Unavailable: a peer was lost or left, or the
                                // job failed or was shut down
  BPS_ERR_TIMEOUT = 4,          // DeadlineExceeded: BYTEPS_OP_TIMEOUT ran out
  BPS_ERR_INTERNAL = 5,         // Internal: a fault of the core itself
  BPS_ERR_MISMATCH = 6,         // FailedPrecondition: workers disagree on a tensor
                                // (shape, dtype, root, reduce op or process set),
                                // as Horovod reports such a mismatch
};

// Called once per enqueued operation with a bps_status; when it is not
// BPS_OK, error holds a message (valid only during the call).
typedef void (*bps_done_fn)(void* ctx, int status, const char* error);

// Starts this process's worker engine from "key=value\n" config text and
// blocks until the cluster has met (or fails). 0 on success, -1 with a
// message in err.
int bps_worker_init(const char* config, char* err, size_t err_len);
// Leaves the cluster cleanly; pending operations fail. Safe to call twice.
void bps_worker_shutdown(void);
// bps_worker_shutdown that tells the other nodes why this worker leaves
// ("was interrupted (SIGINT)", "failed (ValueError: ...)"); "" is a worker
// that finished. The other workers' errors name the reason, and the servers
// of a job that a worker left with a reason exit non-zero.
void bps_worker_leave(const char* reason);
int bps_is_initialized(void);
int bps_rank(void);
int bps_size(void);
int bps_local_rank(void);
int bps_local_size(void);
int bps_cross_rank(void);
int bps_cross_size(void);
int bps_is_homogeneous(void);
/* Horovod's start_timeline: records a timeline into `path` from now on.
 * 0, or -1 when not initialised, -2 when a timeline records already. */
int bps_start_timeline(const char* path);
/* Writes the timeline and stops recording: 0, -1 if none was recording, -2
 * if the file could not be written. Its path goes to `path_out`
 * (NUL-terminated, cut to `len`) for 0 and -2. */
int bps_stop_timeline(char* path_out, size_t len);

// Sums `in` across all workers into `out` (which may alias `in`); both must
// stay valid until `done` runs. Tensors are matched across workers by name;
// a higher priority leaves first. `done` may run before this returns.
void bps_enqueue_push_pull(const char* name, int dtype, const int64_t* shape,
                           int ndim, const void* in, void* out,
                           int64_t priority, bps_done_fn done, void* ctx);

// bps_enqueue_push_pull with two more texts every worker must pass alike:
// `compression`, a compressor for float32 tensors ("" or "none": none; e.g.
// "topk ratio=0.01 ef=1", see docs/compression.md; tensors of other dtypes,
// or smaller than BYTEPS_MIN_COMPRESS_BYTES, travel uncompressed; a bad text
// fails the operation with BPS_ERR_INVALID), and `agreement`, anything else
// the workers must agree on for this name: space-separated key=value terms
// (e.g. "root=1" for a broadcast, "op=average"). Both are declared with the
// shape: workers that differ all fail at once. The term "set=0,2" (rising
// ranks, this worker among them) makes it a process-set operation: only
// those workers take part, and the sum is theirs.
void bps_enqueue_push_pull_ex(const char* name, int dtype, const int64_t* shape, int ndim,
                              const void* in, void* out, int64_t priority,
                              const char* compression, const char* agreement,
                              bps_done_fn done, void* ctx);

// bps_enqueue_push_pull with the servers combining the workers' tensors by
// `reduce_op` instead of summing: 0 sum, 1 min, 2 max, 3 product, in the
// dtype's own arithmetic (integer products wrap; float16/bfloat16 computed
// in float32). Declared with the shape: workers that differ all fail with
// BPS_ERR_INVALID, as does an unknown op or an asynchronous key. `agreement`
// as bps_enqueue_push_pull_ex's ("set=0,2": among a process set).
void bps_enqueue_reduce(const char* name, int dtype, const int64_t* shape, int ndim,
                        const void* in, void* out, int64_t priority, int reduce_op,
                        const char* agreement, bps_done_fn done, void* ctx);

// Horovod's join: this worker has no more data. Waits for its operations
// in flight, then blocks until every worker has joined; meanwhile the
// others' reductions complete with this worker counted as pushing zeros.
// Returns the rank that joined last (the same on every worker), or -1 with
// a message in err. Workers may join again afterwards (next epoch).
int bps_join(char* err, size_t err_len);
// Operations under tensor name `name` fail (BPS_ERR_INVALID) instead of
// completing while a worker has joined: for allgathers, which Horovod
// refuses under join (broadcasts are refused by their root agreement).
void bps_refuse_when_joined(const char* name);

// Gives tensor key `name` a label a person recognises (the variable it
// carries); errors and the timeline show it beside the key. Never matched
// across workers. An empty label removes it.
void bps_set_tensor_label(const char* name, const char* label);
// Says what this worker's program is doing, in its own terms ("fit, epoch
// 4 of 10", "evaluate"); stall warnings show it beside the keys that wait.
// Never sent to other nodes. "" forgets it.
void bps_set_activity(const char* text);

// Puts a split push_pull's wait on the timeline (BYTEPS_TRACE_ON): the
// span, in nanoseconds of std::chrono::steady_clock in this process, from
// the moment `name`'s sum was asked for to the moment it was handed over.
void bps_trace_wait(const char* name, int64_t begin_ns, int64_t end_ns);

// Runs a server (and the scheduler, when the config says so) until the job
// ends. Returns the process exit code; a message in err when non-zero.
int bps_server_run(const char* config, char* err, size_t err_len);

// Holds (1) or releases (0) this worker's queued partitions; lets tests and
// diagnostics observe the scheduling order.
void bps_debug_pause_sends(int paused);

// Counters and the debug send log, as JSON. Returns the length needed.
size_t bps_stats_json(char* buf, size_t len);

// Elastic (docs/elastic.md): asks the scheduler to let this worker leave the
// job at the next commit (SIGTERM). 1 when asked, 0 when this worker is not
// a member of a running job now.
int bps_elastic_request_leave(void);

// Services of the core for the TensorFlow op library, which includes no
// other core header: the graph passes log and hash with them, the kernels
// sum replicas on the host with the servers' arithmetic.

// Log levels, as BYTEPS_LOG_LEVEL names them.
enum bps_log_level {
  BPS_LOG_DEBUG = 0,
  BPS_LOG_INFO = 1,
  BPS_LOG_WARNING = 2,
  BPS_LOG_ERROR = 3,
};
// 1 when a line of `level` is written (the level bps_worker_init or
// bps_server_run set), else 0.
int bps_log_enabled(int level);
// Writes one line to stderr, stamped like the core's own (time, level,
// "worker 1"), whatever the level enabled: callers decide whether to log.
void bps_log(int level, const char* text);
// 64-bit FNV-1a of `len` bytes (the hash tensor keys are derived with).
uint64_t bps_fnv1a64(const void* data, size_t len);
// The `text_len` bytes of `text` as a quoted, escaped JSON string, into buf
// (NUL-terminated, cut to `len`). Returns the length needed, terminator
// included; 6 * text_len + 3 always suffices.
size_t bps_json_quote(const char* text, size_t text_len, char* buf, size_t len);
// dst[i] += src[i] for `count` elements of `dtype` (a bps_dtype), as the
// servers add: float16 and bfloat16 in float32, rounded to nearest even.
void bps_sum_into(int dtype, void* dst, const void* src, size_t count);

#ifdef __cplusplus
}
#endif

#endif  // BPS_TF_CORE_BPS_API_H_
