#include "sum_engine.h"

#include <cstring>

#include "common.h"
#include "reduce.h"

namespace bps {

SumEngine::SumEngine(int server_id, int num_workers, int threads, Post post)
    : server_id_(server_id), num_workers_(num_workers), post_(std::move(post)) {
  if (threads < 1) threads = 1;
  lane_bytes_.assign(static_cast<size_t>(threads), 0);
  for (int i = 0; i < threads; ++i) {
    lanes_.emplace_back(new Lane());
    Lane* lane = lanes_.back().get();
    lane->thread = std::thread([this, lane] { Run(lane); });
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
  for (auto& lane : lanes_) lane->thread.join();
}

void SumEngine::Submit(PushJob&& job) {
  auto it = lane_of_key_.find(job.key);
  size_t idx;
  if (it == lane_of_key_.end()) {
    idx = 0;
    for (size_t i = 1; i < lane_bytes_.size(); ++i) {
      if (lane_bytes_[i] < lane_bytes_[idx]) idx = i;
    }
    lane_bytes_[idx] += job.payload.size();
    lane_of_key_[job.key] = idx;
  } else {
    idx = it->second;
  }
  Lane* lane = lanes_[idx].get();
  {
    std::lock_guard<std::mutex> lock(lane->mu);
    lane->queue.push_back(std::move(job));
  }
  lane->cv.notify_one();
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
  KeyState& st = lane->keys[job.key];
  size_t elem = DTypeSize(job.dtype);
  if (st.dtype < 0) {
    st.dtype = job.dtype;
    st.bytes = job.payload.size();
    st.async = job.async;
    st.pushed.assign(static_cast<size_t>(num_workers_), false);
  }
  if (job.async != st.async) {
    // Only a key collision between an asynchronous and a synchronous name
    // gets here; summing them together would be silently wrong.
    replies->push_back(ErrorReply(
        job.worker, job.key,
        "server " + std::to_string(server_id_) + ": worker " + std::to_string(job.worker) +
            " pushed a partition as " + (job.async ? "asynchronous" : "synchronous") +
            " that another push made " + (st.async ? "asynchronous" : "synchronous")));
    return;
  }
  if (job.dtype != st.dtype || job.payload.size() != st.bytes || elem == 0 ||
      job.payload.size() % elem != 0) {
    replies->push_back(ErrorReply(
        job.worker, job.key,
        "server " + std::to_string(server_id_) + ": worker " + std::to_string(job.worker) +
            " pushed " + std::to_string(job.payload.size()) + " bytes of " +
            DTypeName(job.dtype) + " for a partition that holds " + std::to_string(st.bytes) +
            " bytes of " + DTypeName(st.dtype)));
    return;
  }
  size_t count = st.bytes / elem;

  if (st.async) {
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
    return;
  }

  if (job.round != st.round) {
    if (job.round == st.round + 1) {
      st.early.push_back(std::move(job));
      return;
    }
    replies->push_back(ErrorReply(job.worker, job.key,
                                  "server " + std::to_string(server_id_) + ": worker " +
                                      std::to_string(job.worker) + " pushed round " +
                                      std::to_string(job.round) + " of a partition in round " +
                                      std::to_string(st.round)));
    return;
  }
  if (st.pushed[static_cast<size_t>(job.worker)]) {
    replies->push_back(ErrorReply(job.worker, job.key,
                                  "server " + std::to_string(server_id_) + ": worker " +
                                      std::to_string(job.worker) +
                                      " pushed the same partition twice in one round"));
    return;
  }
  st.pushed[static_cast<size_t>(job.worker)] = true;
  if (!st.has_sum) {
    st.sum = std::move(job.payload);  // adopt the first push's buffer: no copy
    st.has_sum = true;
  } else {
    auto begin = Clock::now();
    SumInto(st.dtype, st.sum.data(), job.payload.data(), count);
    st.sum_ns += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - begin).count());
  }
  if (++st.count < num_workers_) return;

  for (int w = 0; w < num_workers_; ++w) {
    ServerReply r{w, MakeHeader(MsgType::kPullReply, Role::kServer, server_id_), st.sum.Share()};
    r.header.key = job.key;
    r.header.round = st.round;
    r.header.dtype = static_cast<uint16_t>(st.dtype);
    r.header.request_id = st.sum_ns / 1000;  // read by the worker's timeline
    replies->push_back(std::move(r));
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
