// Channel over ZeroMQ: a DEALER per link this node opens and a ROUTER to
// listen on.
#include "channel.h"

#include <cerrno>
#include <cstring>
#include <vector>

#include "auth.h"
#include "common.h"
#include "stats.h"

namespace bps {

namespace {

class ZmqChannel : public Channel {
 public:
  ZmqChannel(int io_threads, Wakeup* wake) : ctx_(io_threads), wake_(wake) {}
  ~ZmqChannel() override { links_.clear(); }  // sockets before the context

  Peer Connect(const std::string& endpoint, const std::string& name) override {
    links_.emplace_back(new Socket(ctx_, zmqc::kDealer, name));
    links_.back()->Connect(endpoint);
    routed_.push_back(false);
    return Peer{static_cast<int>(links_.size() - 1), ""};
  }

  Peer Listen(const std::string& endpoint, int64_t max_message_bytes,
              std::string* bound) override {
    links_.emplace_back(new Socket(ctx_, zmqc::kRouter));
    routed_.push_back(true);
    links_.back()->SetMaxMsgSize(max_message_bytes);
    *bound = links_.back()->Bind(endpoint);
    return Peer{static_cast<int>(links_.size() - 1), ""};
  }

  bool Send(const Peer& to, const FrameHeader& header, Msg&& payload) override {
    Socket* s = Open(to.link);
    if (!s) return false;
    FrameHeader h = header;
    h.payload_bytes = payload.size();
    SealHeader(&h);
    std::vector<Msg> frames;
    if (routed_[static_cast<size_t>(to.link)]) frames.emplace_back(to.route.data(), to.route.size());
    frames.emplace_back(&h, sizeof(h));
    frames.push_back(std::move(payload));
    return s->SendFrames(&frames);
  }

  bool Wait(long timeout_ms) override {
    items_.clear();
    items_.push_back({nullptr, wake_->fd(), zmqc::kPollIn, 0});
    for (auto& s : links_) {
      if (s) items_.push_back({s->get(), 0, zmqc::kPollIn, 0});
    }
    if (zmq_poll(items_.data(), static_cast<int>(items_.size()), timeout_ms) < 0) {
      return zmq_errno() == EINTR;
    }
    if (items_[0].revents) wake_->Drain();
    return true;
  }

  bool Receive(Message* m) override {
    for (; next_ < links_.size(); ++next_) {
      while (links_[next_] && links_[next_]->RecvFrames(&frames_)) {
        if (Unpack(static_cast<int>(next_), m)) return true;
      }
    }
    next_ = 0;
    return false;
  }

  void Close(const Peer& link, int linger_ms) override {
    Socket* s = Open(link.link);
    if (!s) return;
    s->SetLinger(linger_ms);
    links_[static_cast<size_t>(link.link)].reset();
  }

 private:
  Socket* Open(int link) {
    if (link < 0 || static_cast<size_t>(link) >= links_.size()) return nullptr;
    return links_[static_cast<size_t>(link)].get();
  }

  // [route] [header] [payload] on the listening link, [header] [payload]
  // on the others.
  bool Unpack(int link, Message* m) {
    size_t first = routed_[static_cast<size_t>(link)] ? 1 : 0;
    m->from = Peer{link, first ? frames_[0].str() : std::string()};
    std::string bad = frames_.size() != first + 2 ? "unexpected frame count"
                      : ValidateHeader(frames_[first].data(), frames_[first].size(),
                                       frames_[first + 1].size());
    if (!bad.empty()) {
      Stats::Get().frames_dropped++;
      BPS_LOG(kDebug, "dropped a frame" << (first ? " from " + m->from.route : "") << ": " << bad);
      return false;
    }
    std::memcpy(&m->header, frames_[first].data(), sizeof(m->header));
    m->payload = std::move(frames_[first + 1]);
    return true;
  }

  Context ctx_;
  std::vector<std::unique_ptr<Socket>> links_;  // null once closed
  std::vector<bool> routed_;
  Wakeup* wake_;
  std::vector<zmq_pollitem_t> items_;
  std::vector<Msg> frames_;
  size_t next_ = 0;  // the link Receive drains now
};

}  // namespace

std::unique_ptr<Channel> MakeZmqChannel(int io_threads, Wakeup* wake) {
  return std::unique_ptr<Channel>(new ZmqChannel(io_threads, wake));
}

}  // namespace bps
