#include "scheduler/launcher_link.h"

#include <unistd.h>

namespace bps {

LauncherLink::LauncherLink(const Config& cfg)
    : channel_(MakeZmqChannel(1, &wake_, LinkSecurity::FromConfig(cfg))) {
  std::string endpoint =
      Endpoint(cfg.Get("scheduler_host", "127.0.0.1"), cfg.GetInt("scheduler_port", 0));
  scheduler_ = channel_->Connect(endpoint, "launcher-" + std::to_string(getpid()));
  Send("hello=1\n");
}

LauncherLink::~LauncherLink() { Close(); }

void LauncherLink::Send(const std::string& text) {
  if (!channel_ || !scheduler_.valid()) return;
  channel_->Send(scheduler_, MakeHeader(MsgType::kControl, Role::kLauncher, -1), text);
}

std::vector<std::string> LauncherLink::Receive(int timeout_ms) {
  std::vector<std::string> texts;
  if (!channel_) return texts;
  channel_->Wait(timeout_ms);
  Message m;
  while (channel_->Receive(&m)) {
    if (m.header.type == static_cast<uint16_t>(MsgType::kControl)) texts.push_back(m.payload.str());
  }
  return texts;
}

std::string LauncherLink::Refusal() const { return channel_ ? channel_->Refusal() : ""; }

void LauncherLink::Close() {
  if (!channel_) return;
  if (scheduler_.valid()) channel_->Close(scheduler_, 200);  // the last report may still travel
  scheduler_ = Peer();
  channel_.reset();
}

}  // namespace bps
