#include "scheduler/membership.h"

#include <unistd.h>

namespace bps {

void Membership::Join(const std::string& endpoint, const Config& cfg, const Config& extra) {
  // The pid keeps a restarted node's routing id apart from its old one.
  std::string name = std::string("ctl-") + RoleName(role_) + "-" + std::to_string(id_) + "-" +
                     std::to_string(getpid());
  scheduler_ = channel_->Connect(endpoint, name);
  Config hello = extra;
  for (const SharedSetting& s : kSharedSettings) hello.Set(s.key, cfg.Get(s.key));
  hello.Set("hostname", cfg.Get("hostname"));
  hello.Set("pid", std::to_string(getpid()));
  welcomed_ = ready_ = false;
  last_heard_ = last_beat_ = Clock::now();
  Send(MsgType::kHello, hello.Serialize());
}

bool Membership::Handle(const Message& m, const OnWelcome& on_welcome) {
  last_heard_ = Clock::now();
  switch (static_cast<MsgType>(m.header.type)) {
    case MsgType::kWelcome: {
      Config layout = Config::Parse(m.payload.str());
      id_ = static_cast<int>(layout.GetInt("id", id_));
      welcomed_ = true;
      on_welcome(layout);
      Send(MsgType::kBarrier, "");
      return true;
    }
    case MsgType::kBarrierDone:
      ready_ = true;
      return true;
    case MsgType::kHeartbeatAck:
      return true;
    default:
      return false;
  }
}

void Membership::Send(MsgType type, const std::string& payload, uint64_t request_id,
                      uint16_t dtype) {
  if (!joined()) return;
  FrameHeader h = MakeHeader(type, role_, id_);
  h.request_id = request_id;
  h.dtype = dtype;
  channel_->Send(scheduler_, h, payload);
}

void Membership::Tick() {
  if (!joined() || SecondsSince(last_beat_) < heartbeat_s_) return;
  last_beat_ = Clock::now();
  Send(MsgType::kHeartbeat, "");
}

void Membership::Leave(int linger_ms) {
  if (!joined()) return;
  Send(MsgType::kBye, "");
  channel_->Close(scheduler_, linger_ms);
  scheduler_ = Peer();
}

void Membership::Close() {
  if (!joined()) return;
  channel_->Close(scheduler_, 0);
  scheduler_ = Peer();
}

}  // namespace bps
