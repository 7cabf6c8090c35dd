#include "transport/cipher_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "common/common.h"

namespace bps {

namespace {

constexpr int kMaxThreads = 16;

std::atomic<int> g_threads{0};

int AutomaticThreads() {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, std::min(4, cores / 4));
}

// Never destroyed: a process may exit from any thread while an engine is
// sealing, and its threads must not outlive the lock they wait on.
class Pool {
 public:
  void Run(int n, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> lock(mu_);
    if (job_) {  // busy: no waiting on another engine's message
      lock.unlock();
      for (int i = 0; i < n; ++i) fn(i);
      return;
    }
    // Threads are started on first need, after any fork of the process.
    while (static_cast<int>(threads_.size()) < std::min(n, CipherThreads()) - 1) {
      threads_.emplace_back([this] {
        NameThisThread("bps-cipher");
        Serve();
      });
    }
    job_ = &fn;
    next_ = 0;
    total_ = pending_ = n;
    work_.notify_all();
    while (next_ < total_) {
      int i = next_++;
      lock.unlock();
      fn(i);
      lock.lock();
      --pending_;
    }
    done_.wait(lock, [this] { return pending_ == 0; });
    job_ = nullptr;
  }

 private:
  void Serve() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_.wait(lock, [this] { return job_ && next_ < total_; });
      int i = next_++;
      const std::function<void(int)>* fn = job_;
      lock.unlock();
      (*fn)(i);
      lock.lock();
      if (--pending_ == 0) done_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable work_, done_;
  const std::function<void(int)>* job_ = nullptr;
  int next_ = 0, total_ = 0, pending_ = 0;
  std::vector<std::thread> threads_;
};

Pool& ThePool() {
  static Pool* pool = new Pool;
  return *pool;
}

}  // namespace

void SetCipherThreads(int n) {
  g_threads = n <= 0 ? AutomaticThreads() : std::min(n, kMaxThreads);
}

int CipherThreads() {
  int n = g_threads.load();
  return n > 0 ? n : AutomaticThreads();
}

void RunSlices(int n, const std::function<void(int)>& fn) {
  if (n <= 1 || CipherThreads() <= 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  ThePool().Run(n, fn);
}

}  // namespace bps
