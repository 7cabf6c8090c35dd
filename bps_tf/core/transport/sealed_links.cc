#include "transport/sealed_links.h"

namespace bps {

Msg SealedLinks::Opened(int link) {
  Outgoing& o = outgoing_[link];
  o.handshake.reset(new LinkHandshake(key_));
  o.cipher = LinkCipher();
  o.held.clear();
  return o.handshake->Hello();
}

LinkCipher* SealedLinks::Cipher(int link) {
  auto it = outgoing_.find(link);
  return it != outgoing_.end() && it->second.cipher.ready() ? &it->second.cipher : nullptr;
}

void SealedLinks::Hold(int link, const FrameHeader& h, Msg&& payload) {
  outgoing_[link].held.emplace_back(h, std::move(payload));
}

bool SealedLinks::Finish(int link, const Msg& answer, std::string* why) {
  auto it = outgoing_.find(link);
  if (it == outgoing_.end() || !it->second.handshake) {
    *why = "an answer to no hello";
    return false;
  }
  if (!it->second.handshake->Finish(answer, &it->second.cipher, why)) return false;
  it->second.handshake.reset();
  return true;
}

std::deque<std::pair<FrameHeader, Msg>> SealedLinks::TakeHeld(int link) {
  std::deque<std::pair<FrameHeader, Msg>> out;
  auto it = outgoing_.find(link);
  if (it != outgoing_.end()) out.swap(it->second.held);
  return out;
}

bool SealedLinks::Answer(int link, const std::string& route, const Msg& hello, Msg* answer,
                         std::string* why) {
  LinkCipher fresh;
  if (!LinkHandshake::Answer(key_, hello, answer, &fresh, why)) return false;
  BoundUnconfirmed();
  peers_[{link, route}].pending = std::move(fresh);
  return true;
}

LinkCipher* SealedLinks::Cipher(int link, const std::string& route) {
  auto it = peers_.find({link, route});
  return it != peers_.end() && it->second.cipher.ready() ? &it->second.cipher : nullptr;
}

LinkCipher* SealedLinks::Answered(int link, const std::string& route) {
  auto it = peers_.find({link, route});
  if (it == peers_.end()) return nullptr;
  if (it->second.cipher.ready()) return &it->second.cipher;
  return it->second.pending.ready() ? &it->second.pending : nullptr;
}

LinkCipher::Verdict SealedLinks::Open(int link, const std::string& route, const Msg& sealed,
                                      Msg* payload, FrameHeader* h, bool* known,
                                      const PlainSink* sink, bool* delivered) {
  auto out = outgoing_.find(link);
  if (out != outgoing_.end()) {
    *known = out->second.cipher.ready();
    return *known ? out->second.cipher.Open(sealed, payload, h, sink, delivered)
                  : LinkCipher::Verdict::kForged;
  }
  auto it = peers_.find({link, route});
  *known = it != peers_.end();
  if (!*known) return LinkCipher::Verdict::kForged;
  PeerState& p = it->second;
  LinkCipher::Verdict v = LinkCipher::Verdict::kForged;
  if (p.pending.ready()) {
    // A fresh handshake's first message confirms it; one that fails to
    // verify with it may still belong to the link's current cipher.
    v = p.pending.Open(sealed, payload, h, sink, delivered);
    if (v == LinkCipher::Verdict::kOk) p.cipher = std::move(p.pending);
    if (v == LinkCipher::Verdict::kOk || !p.cipher.ready()) return v;
  }
  return p.cipher.Open(sealed, payload, h, sink, delivered);
}

void SealedLinks::Forget(int link, const std::string& route) { peers_.erase({link, route}); }

void SealedLinks::Close(int link) {
  outgoing_.erase(link);
  for (auto it = peers_.begin(); it != peers_.end();) {
    it = it->first.first == link ? peers_.erase(it) : std::next(it);
  }
}

void SealedLinks::BoundUnconfirmed() {
  size_t unconfirmed = 0;
  for (const auto& kv : peers_) unconfirmed += kv.second.cipher.ready() ? 0 : 1;
  if (unconfirmed < kMaxUnconfirmed) return;
  for (auto it = peers_.begin(); it != peers_.end();) {
    it = it->second.cipher.ready() ? std::next(it) : peers_.erase(it);
  }
}

}  // namespace bps
