#include "server/reply_scheduler.h"

#include <utility>

namespace bps {

namespace {

// What libzmq holds while it writes a reply: the reply's own message (a
// shared sum stays alive through it) and where its bytes are owed back.
struct Held {
  Msg keep;
  std::atomic<uint64_t>* released;
  uint64_t bytes;
  const std::function<void()>* wake;
};

}  // namespace

ReplyScheduler::ReplyScheduler(int num_workers, uint64_t credit_bytes,
                               std::function<void()> wake)
    : credit_(credit_bytes), wake_(std::move(wake)) {
  for (int w = 0; w < num_workers; ++w) workers_.emplace_back(new Worker());
}

void ReplyScheduler::Add(std::vector<ServerReply>&& replies) {
  for (auto& r : replies) {
    if (r.worker < 0 || static_cast<size_t>(r.worker) >= workers_.size()) continue;
    workers_[static_cast<size_t>(r.worker)]->queue.push(Entry{r.priority, seq_++, std::move(r)});
    ++queued_;
  }
}

std::vector<ServerReply> ReplyScheduler::Ready(bool ignore_credit) {
  std::vector<ServerReply> out;
  // Most of a server's wake-ups queue no reply (a push came in): with 256
  // workers, looking through every queue each time was 15 % of its loop.
  if (queued_ == 0) return out;
  for (size_t w = 0; w < workers_.size(); ++w) {
    Worker& k = *workers_[w];
    while (!k.queue.empty()) {
      uint64_t in_flight = k.handed - k.released.load();
      uint64_t bytes = k.queue.top().reply.payload.size();
      // One reply always may go, however large, so nothing waits forever.
      if (!ignore_credit && credit_ != 0 && in_flight > 0 && in_flight + bytes > credit_) break;
      out.push_back(std::move(k.queue.top().reply));
      k.queue.pop();
      --queued_;
      k.handed += bytes;  // given back by the Track()ed message that carries it
    }
  }
  return out;
}

void ReplyScheduler::DropQueued() {
  for (auto& k : workers_) {
    while (!k->queue.empty()) k->queue.pop();
  }
  queued_ = 0;
}

Msg ReplyScheduler::Track(int worker, Msg&& payload, uint64_t reserved) {
  if (worker < 0 || static_cast<size_t>(worker) >= workers_.size()) return std::move(payload);
  Worker& k = *workers_[static_cast<size_t>(worker)];
  if (credit_ == 0) {  // nothing waits on the credit: no need to watch
    k.released.fetch_add(reserved);
    return std::move(payload);
  }
  const size_t size = payload.size();
  Held* held = new Held{std::move(payload), &k.released, reserved, &wake_};
  return Msg(held->keep.data(), size, &ReplyScheduler::Release, held);
}

void ReplyScheduler::Release(void*, void* hint) {
  Held* held = static_cast<Held*>(hint);
  held->released->fetch_add(held->bytes);
  const std::function<void()>* wake = held->wake;
  delete held;
  (*wake)();
}

}  // namespace bps
