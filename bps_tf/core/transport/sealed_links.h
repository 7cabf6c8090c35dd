// The state of a channel's sealed links (BYTEPS_ENCRYPTION=1, link_cipher.h):
// a link this node opened waits for the answer to its hello, holding what
// the engine sends meanwhile; on a listening link each peer (route) gets a
// cipher when its hello is answered, which it keeps once a message sealed
// with it verifies. No sockets here: the channel sends what this returns.
#ifndef BPS_TF_CORE_TRANSPORT_SEALED_LINKS_H_
#define BPS_TF_CORE_TRANSPORT_SEALED_LINKS_H_

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "transport/link_cipher.h"

namespace bps {

class SealedLinks {
 public:
  explicit SealedLinks(const std::string& link_key) : key_(link_key) {}

  // ---- links this node opened
  Msg Opened(int link);  // the hello to send before anything else
  LinkCipher* Cipher(int link);  // null until the handshake is done
  // Keeps a message until the handshake is done (TakeHeld then gives it).
  void Hold(int link, const FrameHeader& h, Msg&& payload);
  // The other end's answer; false (*why) if it does not verify.
  bool Finish(int link, const Msg& answer, std::string* why);
  std::deque<std::pair<FrameHeader, Msg>> TakeHeld(int link);

  // ---- listening links: one cipher per peer (route)
  // Answers a peer's hello; false (*why) for one not made with the job's key.
  // A peer that already has a cipher keeps it until a message sealed with
  // the new one verifies, so a replayed hello cannot cut a live link.
  bool Answer(int link, const std::string& route, const Msg& hello, Msg* answer,
              std::string* why);
  LinkCipher* Cipher(int link, const std::string& route);  // null until confirmed
  // The cipher to tell a peer why its message was rejected: the confirmed
  // one, else the one its hello was answered with; null for neither.
  LinkCipher* Answered(int link, const std::string& route);

  // A message on either kind of link. *known: the sender did a verified
  // handshake on this link (its hello was answered, or the answer came);
  // when false, nothing was checked.
  // `sink` and *delivered as in LinkCipher::Open.
  LinkCipher::Verdict Open(int link, const std::string& route, const Msg& sealed, Msg* payload,
                           FrameHeader* h, bool* known, const PlainSink* sink = nullptr,
                           bool* delivered = nullptr);
  void Forget(int link, const std::string& route);  // a peer whose link failed
  void Close(int link);

 private:
  struct Outgoing {
    std::unique_ptr<LinkHandshake> handshake;  // until the answer came
    LinkCipher cipher;
    std::deque<std::pair<FrameHeader, Msg>> held;
  };
  struct PeerState {
    LinkCipher cipher;   // confirmed: a message sealed with it verified
    LinkCipher pending;  // answered, not yet confirmed
  };
  // Peers answered but not yet confirmed are dropped beyond this many, so
  // replayed hellos cannot grow the table without bound.
  static constexpr size_t kMaxUnconfirmed = 1024;

  void BoundUnconfirmed();

  std::string key_;
  std::map<int, Outgoing> outgoing_;
  std::map<std::pair<int, std::string>, PeerState> peers_;
};

}  // namespace bps

#endif  // BPS_TF_CORE_TRANSPORT_SEALED_LINKS_H_
