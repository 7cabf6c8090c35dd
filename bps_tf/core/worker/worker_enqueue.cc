// The worker engine's way in: an operation is checked, described by the
// signature every worker must share, and either scheduled at once (its name
// is declared) or held until the scheduler answers its declaration. The life
// cycle is in worker_engine.cc, the queue in worker_queue.cc.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "common/stats.h"
#include "worker/worker_engine.h"
#include "worker/worker_task.h"

namespace bps {

namespace {
// The ranks after "set=" in an agreement ("root=1 set=0,2"): the process set
// of the operation, which the scheduler and the servers wait for instead of
// every worker. Empty when there is none. Returns why the text is invalid.
std::string ParseMembers(const std::string& agreement, int size, std::vector<int>* members) {
  size_t pos = 0;
  while (pos < agreement.size()) {
    size_t end = agreement.find(' ', pos);
    if (end == std::string::npos) end = agreement.size();
    std::string token = agreement.substr(pos, end - pos);
    pos = end + 1;
    if (token.compare(0, 4, "set=") != 0) continue;
    std::string list = token.substr(4);
    size_t at = 0;
    while (at <= list.size()) {
      size_t comma = list.find(',', at);
      if (comma == std::string::npos) comma = list.size();
      std::string item = list.substr(at, comma - at);
      at = comma + 1;
      char* stop = nullptr;
      long r = item.empty() ? -1 : std::strtol(item.c_str(), &stop, 10);
      if (r < 0 || r >= size || *stop != '\0' ||
          (!members->empty() && r <= members->back())) {
        return "process set '" + list + "' is not a rising list of ranks in [0, " +
               std::to_string(size) + ")";
      }
      members->push_back(static_cast<int>(r));
    }
  }
  return "";
}

// Elastic: the membership epoch an operation was built in ("view=N" in its
// agreement, bps_tf/comm/collectives.py); -1 when it names none.
long ViewOf(const std::string& agreement) {
  size_t at = agreement.find("view=");
  if (at == std::string::npos || (at > 0 && agreement[at - 1] != ' ')) return -1;
  return std::strtol(agreement.c_str() + at + 5, nullptr, 10);
}

std::string JoinRanks(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ",") + std::to_string(r);
  return out;
}

// Why the arguments of a call are refused, before the engine's state is
// read ("" if they are not); *bytes and *spec get what they describe.
std::string CheckArguments(const std::string& name, int dtype, const std::vector<int64_t>& shape,
                           int reduce_op, const std::string& compression, uint64_t* bytes,
                           CompressorSpec* spec) {
  size_t elem = DTypeSize(dtype);
  if (reduce_op < 0 || reduce_op > kMaxReduceOp) {
    return "unknown reduce op " + std::to_string(reduce_op);
  }
  if (reduce_op != 0 && IsAsyncName(name)) {
    return std::string("reduce op ") + ReduceOpName(static_cast<uint8_t>(reduce_op)) +
           " is not available for asynchronous keys (the server keeps a running sum)";
  }
  if (elem == 0) return "unsupported dtype code " + std::to_string(dtype);
  uint64_t count = 1;
  for (int64_t d : shape) {
    if (d < 0) return "negative dimension";
    count *= static_cast<uint64_t>(d);
  }
  *bytes = count * elem;
  try {
    *spec = CompressorSpec::Parse(compression);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// What workers must agree on for this name; the scheduler compares it.
std::string Signature(int dtype, const std::vector<int64_t>& shape, const std::string& agreement,
                      int reduce_op, uint32_t contributors) {
  std::string sig = ShapeString(dtype, shape);
  if (!agreement.empty()) sig += " " + agreement;
  if (reduce_op != 0) {
    // Declared with the shape: workers that reduce a name differently all fail at once.
    sig += std::string(" reduce=") + ReduceOpName(static_cast<uint8_t>(reduce_op));
  }
  // A host sum and a worker's own value never meet in one round.
  if (contributors > 0) sig += " hosts=" + std::to_string(contributors);
  return sig;
}
}  // namespace

std::string WorkerEngine::CheckMembers(const std::string& name, const std::string& agreement,
                                       int reduce_op, uint32_t contributors,
                                       std::vector<int>* members) const {
  std::string bad_set = ParseMembers(agreement, size_, members);
  if (bad_set.empty() && !members->empty()) {
    if (!std::binary_search(members->begin(), members->end(), rank_)) {
      bad_set = "this worker (rank " + std::to_string(rank_) + ") is not in its process set [" +
                JoinRanks(*members) + "]";
    } else if (IsAsyncName(name)) {
      bad_set = "asynchronous keys belong to every worker, not to a process set";
    }
  }
  if (bad_set.empty() && contributors > 0 && (!members->empty() || reduce_op != 0)) {
    // LocalReduce bypasses both: a host sum is a global sum.
    bad_set = "a local-reduce host sum cannot be a process set's or a min/max/product";
  }
  return bad_set;
}

void WorkerEngine::Enqueue(const std::string& name, int dtype, const std::vector<int64_t>& shape,
                           const void* in, void* out, int64_t priority, bps_done_fn done,
                           void* ctx, const std::string& compression,
                           const std::string& agreement, int reduce_op, uint32_t contributors) {
  auto refuse = [&](const std::string& why) {
    done(ctx, BPS_ERR_INVALID, ("push_pull '" + name + "': " + why).c_str());
  };
  uint64_t bytes = 0;
  CompressorSpec spec;
  std::string invalid = CheckArguments(name, dtype, shape, reduce_op, compression, &bytes, &spec);
  if (!invalid.empty()) return refuse(invalid);
  if (!initialized_) {
    done(ctx, BPS_ERR_NOT_INITIALIZED, "bps_tf is not initialized: call bps_tf.init() first");
    return;
  }
  if (local_mode_) {
    if (in != out && bytes) std::memcpy(out, in, bytes);
    Stats::Get().ops_done++;
    done(ctx, BPS_OK, nullptr);
    return;
  }
  std::vector<int> members;
  invalid = CheckMembers(name, agreement, reduce_op, contributors, &members);
  if (!invalid.empty()) return refuse(invalid);
  long view = ViewOf(agreement);
  if (view >= 0 && view != epoch_) {
    // Only ops whose graph holds ranks as constants carry their epoch (a
    // process set's, and code built on the rank it was traced with); the
    // collectives of both faces read size and rank when they run and carry
    // none. Running such an op in another membership would be silently wrong.
    const bool in_set = agreement.find("set=") != std::string::npos;
    return refuse("built in membership epoch " + std::to_string(view) + ", but the workers "
                  "changed since (epoch " + std::to_string(epoch_) + ", " + std::to_string(size_) +
                  " workers), and " +
                  (in_set ? std::string("it belongs to a process set, whose ranks are those of "
                                        "the old membership: register the set again in a reset "
                                        "callback (state.register_reset_callbacks) and build "
                                        "the function that uses it again there")
                          : std::string("its graph holds the ranks of the old membership: "
                                        "build it again after the reset (a tf.function of your "
                                        "own: create it again in a reset callback)")));
  }
  std::string sig = Signature(dtype, shape, agreement, reduce_op, contributors);
  const bool compress = Compresses(spec, dtype, bytes);
  if (compress && reduce_op != 0) {
    return refuse(std::string("reduce op ") + ReduceOpName(static_cast<uint8_t>(reduce_op)) +
                  " cannot be combined with compression (a compressor approximates a sum)");
  }
  // In the signature, so the scheduler refuses workers that disagree.
  if (compress) sig += " " + spec.Text();

  Task* task = new Task();
  task->name = name;
  task->contributors = static_cast<uint32_t>(members.size());
  if (!members.empty() && members.back() <= kMaxMaskRank) {
    for (int r : members) task->members |= 1ULL << r;
  }
  task->dtype = dtype;
  task->reduce_op = static_cast<uint8_t>(reduce_op);
  task->refuse_joined = agreement.compare(0, 5, "root=") == 0;
  task->bytes = bytes;
  task->in = static_cast<const char*>(in);
  task->out = static_cast<char*>(out);
  task->priority = priority;
  task->done = done;
  task->ctx = ctx;
  if (contributors > 0) task->contributors = contributors;
  if (compress) task->compressor = std::make_shared<const CompressorSpec>(spec);
  Submit(task, sig, members, contributors);
}

void WorkerEngine::Submit(Task* task, const std::string& sig, const std::vector<int>& members,
                          uint32_t contributors) {
  const std::string& name = task->name;
  bool complete_now = false;
  std::string error;
  int status = BPS_ERR_INVALID;
  {
    std::lock_guard<std::mutex> lock(mu_);
    task->seq = next_seq_++;
    if (!fatal_.empty()) {
      error = fatal_;
      status = fatal_status_;
    } else if (!peer_left_.empty() && !IsAsyncName(name)) {
      // An asynchronous key is answered by the server alone: it still works.
      error = "push_pull '" + name + "' cannot complete: " + peer_left_;
      status = BPS_ERR_UNAVAILABLE;
    } else if (joining_) {
      error = "push_pull '" + name + "': this worker has called join() and is waiting for the "
              "others; it can make no other call until every worker has joined";
    } else if (names_in_flight_.count(name)) {
      error = "push_pull '" + name +
              "' was started again before the previous one finished; names must be unique "
              "among operations in flight";
    } else {
      names_in_flight_.insert(name);
      if (refuse_joined_names_.count(name)) task->refuse_joined = true;
      complete_now = ScheduleOrDeclareLocked(task, sig, members, contributors, &error);
    }
  }
  if (!error.empty()) {
    Stats::Get().ops_failed++;
    bps_done_fn done = task->done;
    void* ctx = task->ctx;
    delete task;
    done(ctx, status, error.c_str());
    return;
  }
  if (complete_now) {
    Complete(task);
    return;
  }
  wake_.Notify();
}

bool WorkerEngine::ScheduleOrDeclareLocked(Task* task, const std::string& sig,
                                           const std::vector<int>& members,
                                           uint32_t contributors, std::string* error) {
  const std::string& name = task->name;
  std::string sigkey = name + "|" + sig;
  auto it = tensors_.find(sigkey);
  if (it != tensors_.end()) {
    if (!it->second->error.empty()) {
      *error = it->second->error;
      names_in_flight_.erase(name);
      return false;
    }
    return ScheduleLocked(task, it->second);
  }
  auto& waiters = declaring_[sigkey];
  waiters.push_back(task);
  if (waiters.size() == 1) {
    Config kv;
    kv.Set("name", name);
    kv.Set("sig", sig);
    kv.Set("bytes", std::to_string(task->bytes));
    kv.Set("dtype", std::to_string(task->dtype));
    if (!members.empty()) kv.Set("members", JoinRanks(members));
    if (contributors > 0) kv.Set("contributors", std::to_string(contributors));
    uint64_t id = next_request_++;
    request_sig_[id] = sigkey;
    control_outbox_.emplace_back(id, kv.Serialize());
  }
  return false;
}

bool WorkerEngine::Compresses(const CompressorSpec& spec, int dtype, uint64_t bytes) const {
  if (!spec.active() || dtype != BPS_FLOAT32 || bytes < min_compress_bytes_ || bytes == 0) {
    return false;
  }
  // A compressor whose full partition is no smaller than the raw one gains
  // nothing (and would exceed the servers' frame limit).
  uint64_t part = std::min<uint64_t>(bytes, (partition_bytes_ / 4) * 4);
  return CompressedBytes(spec, part / 4) < part;
}

void WorkerEngine::OnDeclared(uint64_t request_id, const Config& kv) {
  std::vector<Task*> finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto rq = request_sig_.find(request_id);
    if (rq == request_sig_.end()) return;
    std::string sigkey = rq->second;
    request_sig_.erase(rq);
    auto info = std::make_shared<TensorInfo>();
    info->error = kv.Get("error");
    if (info->error.empty()) {
      info->key = static_cast<uint64_t>(std::stoull(kv.Get("key", "0")));
      std::string servers = kv.Get("servers");
      size_t pos = 0;
      while (pos < servers.size()) {
        size_t comma = servers.find(',', pos);
        if (comma == std::string::npos) comma = servers.size();
        info->servers.push_back(std::atoi(servers.substr(pos, comma - pos).c_str()));
        pos = comma + 1;
      }
      auto waiters = declaring_[sigkey];
      if (!waiters.empty()) {
        const Task* t = waiters.front();
        info->part_bytes = PartitionBytes(partition_bytes_, DTypeSize(t->dtype));
      }
    }
    // A refused declaration is not kept: the next call under this name (the
    // workers may agree then) declares again instead of failing at once.
    int refused = kv.Get("mismatch") == "1" ? BPS_ERR_MISMATCH : BPS_ERR_INVALID;
    if (info->error.empty()) tensors_[sigkey] = info;
    for (Task* t : declaring_[sigkey]) {
      if (!info->error.empty()) {
        FailTask(t, refused, info->error);
        finished.push_back(t);
      } else if (ScheduleLocked(t, info)) {
        finished.push_back(t);
      }
    }
    declaring_.erase(sigkey);
  }
  for (Task* t : finished) Complete(t);
}

}  // namespace bps
