// Channel::Wait against lost signals (channel.h ChannelSlowWaits): a
// check the tests run, kept out of the channel itself.
#include <chrono>
#include <string>
#include <thread>

#include "transport/channel.h"

namespace bps {

long ChannelSlowWaits(long rounds, long timeout_ms) {
  using Clock = std::chrono::steady_clock;
  const LinkSecurity clear;
  Wakeup wake_a, wake_b;
  auto a = MakeZmqChannel(1, &wake_a, clear);
  auto b = MakeZmqChannel(1, &wake_b, clear);
  std::string bound;
  b->Listen("tcp://127.0.0.1:0", 1 << 20, &bound);
  const Peer to_b = a->Connect(bound, "a");
  const FrameHeader h = MakeHeader(MsgType::kHeartbeat, Role::kWorker, 0);
  // Waits on `c` and reads until nothing is left, as the I/O loops do,
  // until a message came; true if that took most of the timeout (the
  // message was there, its signal lost).
  auto take = [timeout_ms](Channel* c, Message* m) {
    const auto start = Clock::now();
    for (bool got = false; !got;) {
      if (!c->Wait(timeout_ms)) return true;
      for (Message next; c->Receive(&next); got = true) *m = std::move(next);
    }
    return Clock::now() - start > std::chrono::milliseconds(timeout_ms / 2);
  };
  long slow = 0;
  Message m;
  for (long i = 0; i < rounds && slow < 3; ++i) {
    a->Send(to_b, h, "ping");
    if (take(b.get(), &m)) ++slow;
    b->Send(m.from, h, "pong");
    // The pong reaches a's socket; a's next send takes in the command that
    // announced it, and a's wait must still find it.
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    a->Send(to_b, h, "more");
    if (take(a.get(), &m)) ++slow;
    if (take(b.get(), &m)) ++slow;
  }
  return slow;
}

}  // namespace bps
