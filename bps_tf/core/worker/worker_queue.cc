// The worker's partition queue and its credit: what leaves next, and how
// many bytes may be handed to libzmq before it has sent earlier ones.
#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/labels.h"
#include "common/stats.h"
#include "transport/fusion.h"
#include "worker/trace.h"
#include "worker/worker_task.h"

namespace bps {

bool WorkerEngine::Order::operator()(const PartRef& a, const PartRef& b) const {
  // std::priority_queue pops the largest: higher priority, then older task,
  // then the partition order of this worker: each group of (number of
  // servers) consecutive partitions -- consecutive partitions go to
  // different servers -- started at a different one per worker, so the
  // workers do not all feed the same server's link at the same moment, yet
  // push the same partitions at about the same time: a partition's sum
  // completes only when every worker has pushed it. (Starting worker r at
  // partition r*n/size instead made the workers push disjoint halves first,
  // so no sum of a large tensor came back before both halves had gone.)
  if (a.task->priority != b.task->priority) return a.task->priority < b.task->priority;
  if (a.task->seq != b.task->seq) return a.task->seq > b.task->seq;
  const uint32_t n = static_cast<uint32_t>(a.task->info->servers.size());
  const uint32_t group = static_cast<uint32_t>(std::max(engine->num_servers_, 1));
  const uint32_t stagger = static_cast<uint32_t>(engine->rank_);
  return PartitionSendOrder(a.part, n, group, stagger) >
         PartitionSendOrder(b.part, n, group, stagger);
}

void WorkerEngine::PauseSends(bool paused) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    sends_paused_ = paused;
  }
  wake_.Notify();
}

namespace {
double SteadySeconds(Clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}
}  // namespace

double WorkerEngine::BurstLeftLocked() const { return burst_.LimitLeft(SteadySeconds(Clock::now())); }

bool WorkerEngine::ScheduleLocked(Task* task, const std::shared_ptr<TensorInfo>& info) {
  task->info = info;
  task->round = info->next_round++;
  task->scheduled = Clock::now();
  burst_.Enqueued(SteadySeconds(task->scheduled));
  size_t parts = info->servers.size();
  if (Trace::Get().Wants(task->round)) task->times.resize(parts);
  task->remaining = static_cast<int>(2 * parts);
  for (uint32_t p = 0; p < parts; ++p) ready_.push(PartRef{task, p});
  ready_bytes_ += task->bytes;
  return parts == 0;
}

void WorkerEngine::FailTask(Task* task, int status, const std::string& why) {
  std::lock_guard<std::mutex> lock(task->error_mu);
  if (task->error.empty()) {
    task->error = TensorLabels::Get().Annotate(task->name, why);
    task->status = status;
  }
  task->failed = true;
}

void WorkerEngine::Release(Task* task, int count) {
  if (task->remaining.fetch_sub(count) == count) Complete(task);
}

void WorkerEngine::Complete(Task* task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    names_in_flight_.erase(task->name);
    if (names_in_flight_.empty()) state_cv_.notify_all();  // a join() may wait for that
  }
  std::string error;
  int status;
  {
    std::lock_guard<std::mutex> lock(task->error_mu);
    error = task->error;
    status = task->status;
  }
  if (error.empty() && task->info && Trace::Get().Wants(task->round)) {
    Trace::Get().RecordOperation(task->name, task->priority, task->round, task->bytes,
                                 task->start, task->scheduled, Clock::now(), task->times);
  }
  if (error.empty()) {
    Stats::Get().ops_done++;
    task->done(task->ctx, BPS_OK, nullptr);
  } else {
    Stats::Get().ops_failed++;
    task->done(task->ctx, status, error.c_str());
  }
  delete task;
}

namespace {
// What libzmq hands back when it no longer needs a partition's bytes.
struct SentPart {
  WorkerEngine::Task* task;
  uint64_t bytes;
  uint32_t part;
  char* owned;  // the compressed bytes, freed with the part (else null)
};
}  // namespace

void WorkerEngine::FreePart(void*, void* hint) {
  SentPart* sent = static_cast<SentPart*>(hint);
  WorkerEngine& engine = WorkerEngine::Get();
  // The credit counts bytes not yet taken by the kernel: it keeps libzmq's
  // queue short so urgent partitions can overtake, without waiting for the
  // other workers (which could deadlock if workers chose different orders).
  engine.credit_released_ += sent->bytes;
  engine.wake_.Notify();
  Task* task = sent->task;
  if (!task->times.empty()) task->times[sent->part].released = Clock::now();
  delete[] sent->owned;
  delete sent;
  engine.Release(task, 1);
}

namespace {
// A fused payload's buffer; libzmq frees it, which returns its raw bytes'
// credit (the inputs were already released when they were copied in).
struct SentFused {
  uint64_t bytes;
  char* data;
};
}  // namespace

void WorkerEngine::FreeFused(void*, void* hint) {
  SentFused* sent = static_cast<SentFused*>(hint);
  WorkerEngine& engine = WorkerEngine::Get();
  engine.credit_released_ += sent->bytes;
  engine.wake_.Notify();
  delete[] sent->data;
  delete sent;
}

bool WorkerEngine::Fuses(const Task* t, uint64_t len) const {
  // Compressed and asynchronous partitions keep their own message types.
  return fusion_bytes_ > 0 && !t->compressor && !IsAsyncName(t->name) &&
         kFusedPrefixBytes + 2 * FusedCost(len) <= fusion_bytes_;
}

bool WorkerEngine::TakeSendable(std::vector<PartRef>* to_send, std::vector<Task*>* dropped) {
  std::lock_guard<std::mutex> lock(mu_);
  if (cycle_s_ > 0 && !sends_paused_ && !ready_.empty()) {
    // Small partitions wait up to a cycle for others to share a message,
    // unless a full message is already there.
    const PartRef& top = ready_.top();
    if (!top.task->failed && Fuses(top.task, top.task->PartLength(top.part)) &&
        ready_bytes_ < fusion_bytes_) {
      if (hold_since_ == Clock::time_point{}) hold_since_ = Clock::now();
      if (SecondsSince(hold_since_) < cycle_s_) return false;
    }
  }
  hold_since_ = Clock::time_point{};
  // Without the burst's limit a full credit plus the kernel's buffers would
  // leave in arrival order: 20-30 MB per worker on namespace hosts, whose
  // sums then wait for the worker that sends them last (burst.h,
  // docs/performance-history.md, "A train step's push_pulls leave in priority
  // order on every worker").
  const uint64_t credit =
      BurstLeftLocked() > 0 ? std::min(credit_bytes_, partition_bytes_) : credit_bytes_;
  while (!ready_.empty()) {
    PartRef p = ready_.top();
    uint64_t len = p.task->PartLength(p.part);
    if (p.task->failed) {
      ready_.pop();
      ready_bytes_ -= len;
      dropped->push_back(p.task);
      continue;
    }
    uint64_t in_flight = credit_handed_ - credit_released_.load();
    if (sends_paused_ || (in_flight > 0 && in_flight + len > credit)) break;
    ready_.pop();
    ready_bytes_ -= len;
    credit_handed_ += len;
    to_send->push_back(p);
  }
  return true;
}

void WorkerEngine::SendReadyParts() {
  std::vector<PartRef> to_send;
  std::vector<Task*> dropped;
  if (!TakeSendable(&to_send, &dropped)) return;
  for (Task* t : dropped) Release(t, 2);
  // Small partitions for one server that left the queue together travel in
  // one message, placed where the first of them was in the priority order
  // and keeping that order inside.
  struct Outgoing {
    int server;
    std::vector<PartRef> parts;
    uint64_t bytes;
  };
  std::vector<Outgoing> outgoing;
  std::vector<int> open(servers_.size(), -1);  // server -> its group being filled
  for (const PartRef& p : to_send) {
    int server = p.task->info->servers[p.part];
    uint64_t len = p.task->PartLength(p.part);
    if (!Fuses(p.task, len)) {
      outgoing.push_back(Outgoing{server, {p}, 0});
      continue;
    }
    int& g = open[static_cast<size_t>(server)];
    if (g >= 0 && outgoing[static_cast<size_t>(g)].bytes + FusedCost(len) <= fusion_bytes_) {
      outgoing[static_cast<size_t>(g)].parts.push_back(p);
      outgoing[static_cast<size_t>(g)].bytes += FusedCost(len);
      continue;
    }
    g = static_cast<int>(outgoing.size());
    outgoing.push_back(Outgoing{server, {p}, kFusedPrefixBytes + FusedCost(len)});
  }
  for (size_t i = 0; i < outgoing.size(); ++i) {
    bool sent = outgoing[i].parts.size() == 1 ? SendPart(outgoing[i].parts[0])
                                              : SendFused(outgoing[i].server, outgoing[i].parts);
    if (!sent) {
      const int err = zmq_errno();
      std::string why = "sending to server " + std::to_string(outgoing[i].server) + " failed: " +
                        (err == EAGAIN ? std::string("its connection is gone (the server exited?)")
                                       : std::string(zmq_strerror(err)));
      for (size_t j = i + 1; j < outgoing.size(); ++j) {
        for (const PartRef& p : outgoing[j].parts) {
          FailTask(p.task, BPS_ERR_UNAVAILABLE, why);
          Release(p.task, 2);
        }
      }
      if (ServerGone(outgoing[i].server, why)) return;
      Fatal(why, BPS_ERR_UNAVAILABLE);
      return;
    }
  }
}

bool WorkerEngine::SendPart(const PartRef& p) {
  Task* t = p.task;
  uint64_t off = t->PartOffset(p.part);
  uint64_t len = t->PartLength(p.part);
  uint64_t key = PartKey(t->info->key, p.part);
  FrameHeader h = MakeHeader(MsgType::kPush, Role::kWorker, rank_);
  h.epoch = epoch_;
  h.key = key;
  h.round = t->round;
  h.dtype = static_cast<uint16_t>(t->dtype);
  h.contributors = t->contributors;
  h.members = t->members;
  h.reduce_op = t->reduce_op;
  h.request_id = PushPriorityBits(t->priority);
  if (IsAsyncName(t->name)) h.request_id |= kPushAsync;
  if (t->refuse_joined) h.request_id |= kPushRefuseJoined;
  in_flight_[key] = p;
  if (Stats::Get().send_log_on) Stats::Get().RecordSend(t->name, p.part, t->priority);
  if (!t->times.empty()) t->times[p.part].sent = Clock::now();
  Msg payload;
  if (t->compressor) {
    h.type = static_cast<uint16_t>(MsgType::kPushCompressed);
    try {
      payload = CompressPart(t, p.part, key);
    } catch (const std::exception& e) {
      in_flight_.erase(key);
      credit_released_ += len;
      FailTask(t, BPS_ERR_INVALID, std::string("compressing: ") + e.what());
      Release(t, 2);
      return true;  // this task failed; the link is fine
    }
  } else {
    payload = Msg(const_cast<char*>(t->in) + off, len, &FreePart,
                  new SentPart{t, len, p.part, nullptr});
  }
  const uint64_t wire_bytes = payload.size();
  int server = t->info->servers[p.part];
  if (!channel_->Send(servers_[static_cast<size_t>(server)], h, std::move(payload))) return false;
  Stats::Get().partitions_sent++;
  Stats::Get().bytes_sent += wire_bytes;
  return true;
}

bool WorkerEngine::SendFused(int server, const std::vector<PartRef>& parts) {
  FusedBuilder builder;
  uint64_t raw = 0;
  bool log = Stats::Get().send_log_on;
  for (const PartRef& p : parts) {
    Task* t = p.task;
    FusedPart fp;
    std::memset(&fp, 0, sizeof(fp));
    fp.key = PartKey(t->info->key, p.part);
    fp.round = t->round;
    fp.dtype = static_cast<uint16_t>(t->dtype);
    fp.payload_bytes = t->PartLength(p.part);
    fp.contributors = t->contributors;  // a host root's sum stands for its host
    // Everything else a single push's header would say, so the server makes
    // the same job of it.
    fp.members = t->members;
    fp.reduce_op = t->reduce_op;
    fp.request_id = PushPriorityBits(t->priority);
    if (IsAsyncName(t->name)) fp.request_id |= kPushAsync;
    if (t->refuse_joined) fp.request_id |= kPushRefuseJoined;
    raw += fp.payload_bytes;
    builder.Add(fp, t->in + t->PartOffset(p.part));
    in_flight_[fp.key] = p;
    if (log) Stats::Get().RecordSend(t->name, p.part, t->priority);
  }
  uint64_t size = 0;
  char* data = builder.Finish(&size);
  auto now = Clock::now();
  for (const PartRef& p : parts) {
    if (!p.task->times.empty()) p.task->times[p.part].sent = p.task->times[p.part].released = now;
    Release(p.task, 1);  // copied: the input is free again
  }
  Msg payload(data, size, &FreeFused, new SentFused{raw, data});
  FrameHeader h = MakeHeader(MsgType::kPushFused, Role::kWorker, rank_);
  h.epoch = epoch_;
  if (!channel_->Send(servers_[static_cast<size_t>(server)], h, std::move(payload))) return false;
  Stats::Get().partitions_sent += parts.size();
  Stats::Get().fused_messages_sent++;
  Stats::Get().bytes_sent += size;
  return true;
}

Msg WorkerEngine::CompressPart(Task* t, uint32_t part, uint64_t key) {
  const CompressorSpec& spec = *t->compressor;
  uint64_t off = t->PartOffset(part);
  uint64_t len = t->PartLength(part);
  size_t n = static_cast<size_t>(len / sizeof(float));
  size_t size = CompressedBytes(spec, n);
  // Every worker draws randomk's indices from one stream, so the servers'
  // sum stays on those indices; dithering's rounding differs per worker.
  uint64_t who = spec.kind == CompressorKind::kRandomK ? kSharedStream
                                                       : static_cast<uint64_t>(rank_);
  uint64_t stream = StreamSeed(spec.seed, key, t->round, who);
  std::unique_ptr<char[]> buf(new char[size]);
  t->info->compressor_state.Encode(spec, reinterpret_cast<const float*>(t->in + off), n,
                                   static_cast<size_t>(off / sizeof(float)),
                                   static_cast<size_t>(t->bytes / sizeof(float)), stream,
                                   /*use_momentum=*/true, buf.get());
  char* data = buf.release();
  // The credit counts the raw length, as it was charged.
  return Msg(data, size, &FreePart, new SentPart{t, len, part, data});
}

}  // namespace bps
