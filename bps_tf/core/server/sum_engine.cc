#include "server/sum_engine.h"

#include <cstring>

#include "common/common.h"
#include "math/reduce.h"

namespace bps {

namespace {

// From this payload size up a key has a summing thread of its own (below,
// its sum costs less than handing it to a thread and back).
constexpr size_t kOwnThreadBytes = 64 << 10;

// An error a worker matches to its pending push by the round it sent.
ServerReply RoundError(const PushJob& job, ServerReply&& r) {
  r.header.round = job.round;
  return std::move(r);
}
}  // namespace

bool SumEngine::IsMember(const KeyState& st, int worker) {
  if (st.contributors == 0 || st.members == 0) return true;
  return worker <= kMaxMaskRank && ((st.members >> worker) & 1) != 0;
}

SumEngine::SumEngine(int server_id, int num_workers, int threads, Post post)
    : server_id_(server_id), num_workers_(num_workers), post_(std::move(post)) {
  if (threads < 1) threads = 1;
  lane_bytes_.assign(static_cast<size_t>(threads), 0);
  for (int i = 0; i <= threads; ++i) {
    lanes_.emplace_back(new Lane());
    lanes_.back()->joined.assign(static_cast<size_t>(num_workers), false);
  }
  join_lanes_left_ = static_cast<int>(lanes_.size());
  // The last lane, small keys', runs on the caller's thread (Flush).
  for (int i = 0; i < threads; ++i) {
    Lane* lane = lanes_[static_cast<size_t>(i)].get();
    lane->thread = std::thread([this, lane] {
      NameThisThread("bps-sum");
      Run(lane);
    });
  }
}

SumEngine::~SumEngine() {
  for (auto& lane : lanes_) {
    {
      std::lock_guard<std::mutex> lock(lane->mu);
      lane->stop = true;
    }
    lane->cv.notify_one();
  }
  for (auto& lane : lanes_) {
    if (lane->thread.joinable()) lane->thread.join();
  }
}

void SumEngine::Submit(PushJob&& job) {
  auto it = lane_of_key_.find(job.key);
  size_t idx;
  if (it == lane_of_key_.end()) {
    // A small key's sum takes far less than waking a thread: small keys
    // are summed on this (the I/O) thread; large ones go to the summing
    // thread with the fewest bytes. A compressed push is small for a large
    // partition (decompressing and re-compressing it is the large part).
    idx = lanes_.size() - 1;
    if (job.compressed || job.payload.size() >= kOwnThreadBytes) {
      idx = 0;
      for (size_t i = 1; i < lane_bytes_.size(); ++i) {
        if (lane_bytes_[i] < lane_bytes_[idx]) idx = i;
      }
      lane_bytes_[idx] += job.payload.size();
    }
    lane_of_key_[job.key] = idx;
  } else {
    idx = it->second;
  }
  Queue(lanes_[idx].get(), std::move(job));
}

void SumEngine::Queue(Lane* lane, PushJob&& job) {
  {
    std::lock_guard<std::mutex> lock(lane->mu);
    lane->queue.push_back(std::move(job));
  }
  // The small keys' lane has no thread: Flush sums what it holds.
  if (lane != lanes_.back().get()) lane->cv.notify_one();
}

void SumEngine::Flush() {
  Lane* own = lanes_.back().get();
  std::deque<PushJob> batch;
  {
    std::lock_guard<std::mutex> lock(own->mu);
    batch.swap(own->queue);
  }
  if (batch.empty()) return;
  std::vector<ServerReply> replies;
  for (auto& job : batch) Process(own, std::move(job), &replies);
  if (!replies.empty()) post_(std::move(replies));
}

void SumEngine::SubmitJoin(int worker) {
  // Every lane sees it after the worker's pushes queued there.
  for (auto& lane : lanes_) {
    PushJob job{};
    job.worker = worker;
    job.join = true;
    Queue(lane.get(), std::move(job));
  }
}

void SumEngine::OnJoin(Lane* lane, int worker, std::vector<ServerReply>* replies) {
  if (!lane->joined[static_cast<size_t>(worker)]) {
    lane->joined[static_cast<size_t>(worker)] = true;
    ++lane->joined_count;
  }
  for (auto& kv : lane->keys) MaybeComplete(lane, kv.first, kv.second, replies);
  if (lane->joined_count < num_workers_) return;
  // Every worker has joined: no round of this lane is open (each open one
  // had a pusher, and every pusher has joined since), so it starts afresh.
  lane->joined.assign(static_cast<size_t>(num_workers_), false);
  lane->joined_count = 0;
  if (join_lanes_left_.fetch_sub(1) != 1) return;
  join_lanes_left_ = static_cast<int>(lanes_.size());
  for (int w = 0; w < num_workers_; ++w) {
    replies->push_back(ServerReply{w, MakeHeader(MsgType::kJoin, Role::kServer, server_id_), Msg()});
    // After every sum still queued for the worker: the notice means the
    // server has nothing more for it.
    replies->back().priority = INT32_MIN;
  }
}

void SumEngine::Run(Lane* lane) {
  std::vector<ServerReply> replies;
  while (true) {
    std::deque<PushJob> batch;
    {
      std::unique_lock<std::mutex> lock(lane->mu);
      lane->cv.wait(lock, [lane] { return lane->stop || !lane->queue.empty(); });
      if (lane->stop) return;
      batch.swap(lane->queue);
    }
    for (auto& job : batch) Process(lane, std::move(job), &replies);
    if (!replies.empty()) {
      post_(std::move(replies));
      replies.clear();
    }
  }
}

ServerReply SumEngine::ErrorReply(int worker, uint64_t key, const std::string& why) {
  BPS_LOG(kWarning, why);
  ServerReply r{worker, MakeHeader(MsgType::kError, Role::kServer, server_id_), Msg(why.data(), why.size())};
  r.header.key = key;
  return r;
}

void SumEngine::Process(Lane* lane, PushJob&& job, std::vector<ServerReply>* replies) {
  if (job.join) return OnJoin(lane, job.worker, replies);
  KeyState& st = lane->keys[job.key];
  if (st.dtype < 0) AdoptFirstPush(st, job);
  if (!Agrees(st, job, replies) || !Fits(st, job, replies)) return;
  size_t count = st.bytes / DTypeSize(job.dtype);
  if (st.async) return AnswerAsync(st, job, count, replies);
  if (!TakesPart(lane, st, job, replies)) return;
  if (!Accumulate(st, job, count, replies)) return;
  st.priority = st.count == 0 ? job.priority : std::max(st.priority, job.priority);
  ++st.count;
  MaybeComplete(lane, job.key, st, replies);
}

void SumEngine::AdoptFirstPush(KeyState& st, const PushJob& job) {
  st.dtype = job.dtype;
  st.bytes = job.payload.size();
  st.async = job.async;
  st.compressed = job.compressed;
  st.reduce_op = job.reduce_op;
  st.refuse_joined = job.refuse_joined;
  st.pushed.assign(static_cast<size_t>(num_workers_), false);
  st.skipped.assign(static_cast<size_t>(num_workers_), 0);
  st.contributors = job.contributors;
  st.members = job.members;
  st.needed = job.contributors == 0 ? num_workers_ : static_cast<int>(job.contributors);
}

bool SumEngine::Agrees(const KeyState& st, const PushJob& job, std::vector<ServerReply>* replies) {
  if (job.contributors != st.contributors || job.members != st.members ||
      job.contributors > static_cast<uint32_t>(num_workers_)) {
    // Workers that disagree on who takes part (a process set) would make a
    // round complete too early or never: refuse the push instead.
    replies->push_back(ErrorReply(
        job.worker, job.key,
        "server " + std::to_string(server_id_) + ": worker " + std::to_string(job.worker) +
            " pushed key " + std::to_string(job.key) + " for " +
            std::to_string(job.contributors) + " contributors, but it was first pushed for " +
            std::to_string(st.contributors) + " (0 = every worker; the job has " +
            std::to_string(num_workers_) + "), or for another process set of that size "
            "(BYTEPS_LOCAL_REDUCE must agree on every node)"));
    return false;
  }
  if (job.async != st.async) {
    // Only a key collision between an asynchronous and a synchronous name
    // gets here; summing them together would be silently wrong.
    replies->push_back(ErrorReply(
        job.worker, job.key,
        "server " + std::to_string(server_id_) + ": worker " + std::to_string(job.worker) +
            " pushed a partition as " + (job.async ? "asynchronous" : "synchronous") +
            " that another push made " + (st.async ? "asynchronous" : "synchronous")));
    return false;
  }
  if (job.reduce_op != st.reduce_op) {
    // Workers that reduce one key differently would get a mixed result.
    replies->push_back(RoundError(job, ErrorReply(
        job.worker, job.key,
        "server " + std::to_string(server_id_) + ": worker " + std::to_string(job.worker) +
            " pushed key " + std::to_string(job.key) + " with reduce op " +
            ReduceOpName(job.reduce_op) + ", another push of it has reduce op " +
            ReduceOpName(st.reduce_op) + " (every worker must reduce a tensor the same way)")));
    return false;
  }
  if (job.reduce_op != 0 && (job.compressed || job.async)) {
    replies->push_back(ErrorReply(
        job.worker, job.key,
        "server " + std::to_string(server_id_) + ": reduce op " + ReduceOpName(job.reduce_op) +
            " cannot be combined with " + (job.async ? "asynchronous training" : "compression") +
            " (key " + std::to_string(job.key) + ")"));
    return false;
  }
  return true;
}

bool SumEngine::Fits(KeyState& st, const PushJob& job, std::vector<ServerReply>* replies) {
  size_t elem = DTypeSize(job.dtype);
  if (job.compressed || st.compressed) {
    std::string why = CheckCompressed(st, job);
    if (!why.empty()) {
      replies->push_back(ErrorReply(job.worker, job.key,
                                    "server " + std::to_string(server_id_) + ": worker " +
                                        std::to_string(job.worker) + " " + why));
      return false;
    }
  } else if (job.dtype != st.dtype || job.payload.size() != st.bytes || elem == 0 ||
      job.payload.size() % elem != 0) {
    replies->push_back(ErrorReply(
        job.worker, job.key,
        "server " + std::to_string(server_id_) + ": worker " + std::to_string(job.worker) +
            " pushed " + std::to_string(job.payload.size()) + " bytes of " +
            DTypeName(job.dtype) + " for a partition that holds " + std::to_string(st.bytes) +
            " bytes of " + DTypeName(st.dtype)));
    return false;
  }
  if (st.async && st.compressed) {
    replies->push_back(ErrorReply(job.worker, job.key,
                                  "server " + std::to_string(server_id_) +
                                      ": gradient compression is not available in asynchronous "
                                      "training (the running value would be re-compressed at "
                                      "every push); use compression none"));
    return false;
  }
  return true;
}

void SumEngine::AnswerAsync(KeyState& st, const PushJob& job, size_t count,
                            std::vector<ServerReply>* replies) {
  // The server keeps the value: a push adds to it, the reply is a copy of
  // the sum, taken now (a later push must not change a reply in flight).
  if (!st.has_sum) {
    st.sum = Msg(st.bytes);
    std::memset(st.sum.data(), 0, st.bytes);
    st.has_sum = true;
  }
  SumInto(st.dtype, st.sum.data(), job.payload.data(), count);
  ServerReply r{job.worker, MakeHeader(MsgType::kPullReply, Role::kServer, server_id_),
                Msg(st.sum.data(), st.bytes)};
  r.header.key = job.key;
  r.header.round = job.round;
  r.header.dtype = static_cast<uint16_t>(st.dtype);
  replies->push_back(std::move(r));
}

bool SumEngine::TakesPart(Lane* lane, KeyState& st, PushJob& job,
                          std::vector<ServerReply>* replies) {
  if (lane->joined[static_cast<size_t>(job.worker)]) {
    ServerReply r = ErrorReply(job.worker, job.key,
                               "server " + std::to_string(server_id_) + ": worker " +
                                   std::to_string(job.worker) +
                                   " pushed after it joined (join() must be its last call "
                                   "until every worker has joined)");
    r.header.round = job.round;
    replies->push_back(std::move(r));
    return false;
  }
  // The worker's round counts its own pushes; rounds it sat out joined
  // happened without them.
  const uint64_t round = job.round + st.skipped[static_cast<size_t>(job.worker)];
  if (round != st.round) {
    if (round == st.round + 1) {
      st.early.push_back(std::move(job));
      return false;
    }
    replies->push_back(ErrorReply(job.worker, job.key,
                                  "server " + std::to_string(server_id_) + ": worker " +
                                      std::to_string(job.worker) + " pushed round " +
                                      std::to_string(round) + " of a partition in round " +
                                      std::to_string(st.round)));
    return false;
  }
  if (st.pushed[static_cast<size_t>(job.worker)]) {
    replies->push_back(ErrorReply(job.worker, job.key,
                                  "server " + std::to_string(server_id_) + ": worker " +
                                      std::to_string(job.worker) +
                                      " pushed the same partition twice in one round"));
    return false;
  }
  return true;
}

bool SumEngine::Accumulate(KeyState& st, PushJob& job, size_t count,
                           std::vector<ServerReply>* replies) {
  if (st.compressed) {
    auto begin = Clock::now();
    try {
      AddCompressed(st, job);
    } catch (const std::exception& e) {
      replies->push_back(ErrorReply(job.worker, job.key,
                                    "server " + std::to_string(server_id_) + ": worker " +
                                        std::to_string(job.worker) + " pushed a compressed "
                                        "partition that does not decompress: " + e.what()));
      return false;
    }
    st.pushed[static_cast<size_t>(job.worker)] = true;
    st.sum_ns += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - begin).count());
  } else if (!st.has_sum) {
    st.pushed[static_cast<size_t>(job.worker)] = true;
    st.sum = std::move(job.payload);  // adopt the first push's buffer: no copy
    st.has_sum = true;
  } else {
    st.pushed[static_cast<size_t>(job.worker)] = true;
    auto begin = Clock::now();
    ReduceInto(st.reduce_op, st.dtype, st.sum.data(), job.payload.data(), count);
    st.sum_ns += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - begin).count());
  }
  return true;
}

void SumEngine::MaybeComplete(Lane* lane, uint64_t key, KeyState& st,
                              std::vector<ServerReply>* replies) {
  if (st.async || st.count == 0) return;
  std::string joined;  // workers that joined without pushing this round
  uint64_t joined_mask = 0;
  int absent = 0;
  for (int w = 0; w < num_workers_; ++w) {
    if (st.pushed[static_cast<size_t>(w)] || !lane->joined[static_cast<size_t>(w)]) continue;
    if (!IsMember(st, w)) continue;  // joined, but not in this key's process set
    joined += (joined.empty() ? "" : ", ") + std::to_string(w);
    if (w <= kMaxMaskRank) joined_mask |= uint64_t{1} << w;
    ++absent;
  }
  std::string refused;
  // A process set with a rank past the header's member mask: the server
  // cannot tell whether a joined worker belongs to it, so such a round
  // fails rather than completing too early or waiting forever. A local-reduce
  // host sum (members 0, contributors = hosts) takes the same path: it
  // completes after `contributors` pushes, and join() is refused on the
  // workers while local reduce is active.
  const bool unknown_set = st.contributors != 0 && st.members == 0;
  if (unknown_set && st.count >= st.needed) {
    absent = 0;
  } else if (unknown_set && absent > 0) {
    refused = "server " + std::to_string(server_id_) + ": worker(s) " + joined +
              " joined while a process set with a rank above " + std::to_string(kMaxMaskRank) +
              " was reducing; such a set cannot run while a worker has joined (the servers "
              "cannot tell its members)";
  } else if (st.count + absent < st.needed) {
    return;
  }
  if (refused.empty() && absent > 0 && st.refuse_joined) {
    refused = "server " + std::to_string(server_id_) + ": worker(s) " + joined +
              " joined before this broadcast or allgather; it cannot run while a worker has "
              "joined (as in Horovod; a gradient that is an IndexedSlices is allgathered: pass "
              "sparse_as_dense=True)";
  } else if (refused.empty() && absent > 0 &&
             st.reduce_op != static_cast<uint8_t>(ReduceOp::kSum) && !st.compressed) {
    // A joined worker contributes zeros (as in Horovod): they change a
    // min, max or product, not a sum.
    Msg zeros(st.bytes);
    std::memset(zeros.data(), 0, st.bytes);
    ReduceInto(st.reduce_op, st.dtype, st.sum.data(), zeros.data(), st.bytes / DTypeSize(st.dtype));
  }
  if (st.compressed && refused.empty()) st.sum = CompressSum(st, key);
  ReplyRound(key, st, refused, joined_mask, replies);
  NextRound(lane, st, replies);
}

void SumEngine::ReplyRound(uint64_t key, KeyState& st, const std::string& refused,
                           uint64_t joined_mask, std::vector<ServerReply>* replies) {
  // Every worker that pushed gets the same sum: encrypted once for all.
  std::shared_ptr<SharedSealSlot> shared;
  if (refused.empty() && st.count > 1) shared = std::make_shared<SharedSealSlot>();
  for (int w = 0; w < num_workers_; ++w) {
    if (!st.pushed[static_cast<size_t>(w)]) continue;  // not in the set, or joined
    const uint64_t their_round = st.round - st.skipped[static_cast<size_t>(w)];
    if (!refused.empty()) {
      ServerReply r = ErrorReply(w, key, refused);
      r.header.round = their_round;
      replies->push_back(std::move(r));
      continue;
    }
    ServerReply r{w, MakeHeader(MsgType::kPullReply, Role::kServer, server_id_), st.sum.Share()};
    r.header.key = key;
    r.header.round = their_round;
    r.header.dtype = static_cast<uint16_t>(st.dtype);
    r.header.request_id = st.sum_ns / 1000;  // read by the worker's timeline
    r.priority = st.priority;
    // Who was counted as joined: the worker learns that their joins came
    // before its own, which the scheduler needs to name the last one.
    r.header.members = joined_mask;
    r.header.contributors = static_cast<uint32_t>(__builtin_popcountll(joined_mask));
    r.shared = shared;
    replies->push_back(std::move(r));
  }
}

void SumEngine::NextRound(Lane* lane, KeyState& st, std::vector<ServerReply>* replies) {
  // Only its joined members sat this round out; other workers never push the key.
  for (int w = 0; w < num_workers_; ++w) {
    if (!st.pushed[static_cast<size_t>(w)] && lane->joined[static_cast<size_t>(w)] &&
        IsMember(st, w)) {
      ++st.skipped[static_cast<size_t>(w)];
    }
  }
  st.sum_ns = 0;
  st.sum = Msg();
  st.has_sum = false;
  st.count = 0;
  st.pushed.assign(static_cast<size_t>(num_workers_), false);
  ++st.round;
  std::deque<PushJob> early;
  early.swap(st.early);
  for (auto& e : early) Process(lane, std::move(e), replies);
}

}  // namespace bps
