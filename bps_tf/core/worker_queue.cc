// The worker's partition queue and its credit: what leaves next, and how
// many bytes may be handed to libzmq before it has sent earlier ones.
#include <algorithm>

#include "labels.h"
#include "stats.h"
#include "trace.h"
#include "worker_task.h"

namespace bps {

bool WorkerEngine::Order::operator()(const PartRef& a, const PartRef& b) const {
  // std::priority_queue pops the largest: higher priority, then older task,
  // then the partition order of this worker (which starts at first_part).
  if (a.task->priority != b.task->priority) return a.task->priority < b.task->priority;
  if (a.task->seq != b.task->seq) return a.task->seq > b.task->seq;
  size_t n = a.task->info->servers.size();
  return (a.part + n - a.task->first_part) % n > (b.part + n - b.task->first_part) % n;
}

void WorkerEngine::PauseSends(bool paused) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    sends_paused_ = paused;
  }
  wake_.Notify();
}

bool WorkerEngine::ScheduleLocked(Task* task, const std::shared_ptr<TensorInfo>& info) {
  task->info = info;
  task->round = info->next_round++;
  task->scheduled = Clock::now();
  size_t parts = info->servers.size();
  // Workers start a large tensor at different partitions, so they do not all
  // feed the same server's link at the same moment.
  task->first_part = static_cast<uint32_t>(parts * static_cast<size_t>(rank_) /
                                           static_cast<size_t>(std::max(size_, 1)));
  if (Trace::Get().Wants(task->round)) task->times.resize(parts);
  task->remaining = static_cast<int>(2 * parts);
  for (uint32_t p = 0; p < parts; ++p) ready_.push(PartRef{task, p});
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

void WorkerEngine::SendReadyParts() {
  std::vector<PartRef> to_send;
  std::vector<Task*> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (!ready_.empty()) {
      PartRef p = ready_.top();
      if (p.task->failed) {
        ready_.pop();
        dropped.push_back(p.task);
        continue;
      }
      uint64_t len = p.task->PartLength(p.part);
      uint64_t in_flight = credit_handed_ - credit_released_.load();
      if (sends_paused_ || (in_flight > 0 && in_flight + len > credit_bytes_)) break;
      ready_.pop();
      credit_handed_ += len;
      to_send.push_back(p);
    }
  }
  for (Task* t : dropped) Release(t, 2);
  bool log = Stats::Get().send_log_on;
  for (size_t i = 0; i < to_send.size(); ++i) {
    const PartRef& p = to_send[i];
    Task* t = p.task;
    uint64_t off = t->PartOffset(p.part);
    uint64_t len = t->PartLength(p.part);
    uint64_t key = PartKey(t->info->key, p.part);
    FrameHeader h = MakeHeader(MsgType::kPush, Role::kWorker, rank_);
    h.key = key;
    h.round = t->round;
    h.dtype = static_cast<uint16_t>(t->dtype);
    h.contributors = t->contributors;
    if (IsAsyncName(t->name)) h.request_id = kPushAsync;
    in_flight_[key] = p;
    if (log) Stats::Get().RecordSend(t->name, p.part, t->priority);
    if (!t->times.empty()) t->times[p.part].sent = Clock::now();
    FrameHeader h_sent = h;
    Msg payload;
    if (t->compressor) {
      h_sent.type = static_cast<uint16_t>(MsgType::kPushCompressed);
      try {
        payload = CompressPart(t, p.part, key);
      } catch (const std::exception& e) {
        in_flight_.erase(key);
        credit_released_ += len;
        FailTask(t, BPS_ERR_INVALID, std::string("compressing: ") + e.what());
        Release(t, 2);
        continue;
      }
    } else {
      payload = Msg(const_cast<char*>(t->in) + off, len, &FreePart,
                    new SentPart{t, len, p.part, nullptr});
    }
    const uint64_t wire_bytes = payload.size();
    int server = t->info->servers[p.part];
    if (!channel_->Send(servers_[static_cast<size_t>(server)], h_sent, std::move(payload))) {
      std::string why = "sending to server " + std::to_string(server) + " failed: " +
                        zmq_strerror(zmq_errno());
      for (size_t j = i + 1; j < to_send.size(); ++j) {
        FailTask(to_send[j].task, BPS_ERR_UNAVAILABLE, why);
        Release(to_send[j].task, 2);
      }
      Fatal(why, BPS_ERR_UNAVAILABLE);
      return;
    }
    Stats::Get().partitions_sent++;
    Stats::Get().bytes_sent += wire_bytes;
  }
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
