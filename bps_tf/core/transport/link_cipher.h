// The encryption of BYTEPS_ENCRYPTION=1 on one TCP link, built from
// libsodium's primitives only (docs/reliability.md#security has the threat
// model). ZeroMQ carries the bytes (behind a PLAIN gate that presents a
// public label: nothing derived from the token alone is ever sent, since a
// recording of it would let anyone test guesses of the token offline);
// everything that protects them is here:
//   handshake  one message each way, before any other. Each end sends a
//              fresh X25519 public key (crypto_kx) and the AEADs it runs,
//              under a MAC keyed with the job's link key (keyed BLAKE2b);
//              the answer's MAC covers the hello too. Only holders of the
//              token pass, and both ends contribute fresh keys, so a
//              recorded handshake replayed later yields keys nobody holds.
//   keys       one per direction and link: BLAKE2b keyed with the link key
//              over crypto_kx's session key and both handshake messages.
//              The ephemeral secrets are wiped once used, so a token that
//              leaks later does not open recorded traffic.
//   messages   [sealed header][ciphertext]. The payload is encrypted with
//              the AEAD in k slices, slice i under nonce (counter, 1 + i),
//              their tags in the sealed header (k > 1 only for large
//              messages, so that several threads share the work:
//              cipher_pool.h); the 64-byte header is encrypted under nonce
//              (counter, 0) with the counter and those tags as associated
//              data.
//              The counter numbers this direction's messages from 1, so no
//              nonce repeats under a key; a receiver accepts only a counter
//              above the last it accepted, so a replayed or reordered
//              message is refused, and a changed one fails its tag.
//   shared     a payload that goes unchanged to several links (a server's
//              sum, to each worker) is encrypted once (SharedSeal): under a
//              fresh random key that seals nothing else, slice i under nonce
//              (0, 1 + i). Each link's message then carries that key inside
//              its sealed header (the header's plaintext is the FrameHeader
//              and the key), with the slices' tags as associated data as
//              above; the counter's top bit, also covered, says which form
//              a message has. The server's encryption of a sum no longer
//              grows with the number of workers.
// The AEAD is AEGIS-128L where the CPU has AES instructions (then AEGIS-256:
// 7.9 GB/s per core here, against 3.2 for AES-256-GCM and 1.0 for the
// XSalsa20-Poly1305 of ZeroMQ's CURVE), else XChaCha20-Poly1305; the
// listening end picks the first of its own order that the connecting end
// offers.
#ifndef BPS_TF_CORE_TRANSPORT_LINK_CIPHER_H_
#define BPS_TF_CORE_TRANSPORT_LINK_CIPHER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "transport/protocol.h"
#include "transport/transport.h"

namespace bps {

constexpr size_t kLinkKeyBytes = 32;

enum class Suite : uint8_t {
  kAegis256 = 1,
  kAes256Gcm = 2,
  kXChaCha20Poly1305 = 3,
  kAegis128L = 4,
};
const char* SuiteName(Suite s);

// Why BYTEPS_ENCRYPTION=1 cannot run in this process (no libsodium loaded,
// or one without any AEAD we use), for the user; empty when it can.
std::string SodiumMissing();
// "libsodium 1.0.20, AEGIS-256 preferred (AES instructions)", for logs.
std::string SodiumDescribe();

// A handshake record, a refusal record (below) or neither: one-frame
// messages on a link, told apart from the protocol's two-frame ones.
bool IsHandshakeRecord(const Msg& m);
bool IsRefusalRecord(const Msg& m);
// A refusal in clear: "this end uses <security>", sent to a peer whose
// first words show it uses other settings. It authenticates nothing: a
// node reads one only from a link that carries no verified message yet.
Msg RefusalRecord(const std::string& security);
std::string RefusalText(const Msg& m);

// Where an opened message's plaintext may go: given the verified header and
// the payload's size, a buffer of that size, or null to decrypt in place.
// Writing the plaintext straight to where the engine wants it spares one
// copy of every byte received.
using PlainSink = std::function<char*(const FrameHeader& h, size_t bytes)>;

// A payload encrypted once for several links (above, "shared"). The key is
// wiped and the ciphertext freed when the last link's message is released.
class SharedSeal {
 public:
  // Encrypts `plain` under a fresh key of the suite (the caller's link's).
  SharedSeal(Suite suite, const Msg& plain);
  ~SharedSeal();
  SharedSeal(const SharedSeal&) = delete;
  SharedSeal& operator=(const SharedSeal&) = delete;
  Suite suite() const { return suite_; }
  size_t size() const { return size_; }

 private:
  friend class LinkCipher;
  Suite suite_;
  unsigned char key_[kLinkKeyBytes] = {};
  std::string tags_;  // one per slice
  char* cipher_ = nullptr;
  size_t size_ = 0;
};

// What a payload's several sends share (channel.h SendShared): the first
// send on a sealed link fills it, the others reuse its encryption.
struct SharedSealSlot {
  std::shared_ptr<SharedSeal> seal;
};

// One link's keys and counters, once the handshake is done.
class LinkCipher {
 public:
  LinkCipher() = default;
  ~LinkCipher();
  LinkCipher(LinkCipher&& other) noexcept;
  LinkCipher& operator=(LinkCipher&& other) noexcept;
  LinkCipher(const LinkCipher&) = delete;
  LinkCipher& operator=(const LinkCipher&) = delete;

  bool ready() const { return suite_ != 0; }
  Suite suite() const { return static_cast<Suite>(suite_); }
  // Appends [sealed header][ciphertext]. The ciphertext's buffer keeps
  // `payload` alive until libzmq releases it, so whatever a free function
  // of `payload` reports (a sender's credit) happens when it did before.
  void Seal(const FrameHeader& h, Msg&& payload, std::vector<Msg>* frames);
  // The same message with a payload encrypted once for several links (of
  // this link's suite): only the header is sealed here. `keep` (the
  // plaintext this link would have sent) lives until libzmq releases this
  // link's ciphertext, for whatever its free function reports.
  void SealShared(const FrameHeader& h, const std::shared_ptr<SharedSeal>& payload, Msg&& keep,
                  std::vector<Msg>* frames);

  enum class Verdict { kOk, kForged, kReplayed };
  // Checks and decrypts a received message: *h gets the header, `payload`
  // is decrypted in place, or to the buffer `sink` names for it (then
  // *delivered is set). Nothing is accepted unless both tags verify;
  // kReplayed: authentic, but its counter is not above the last accepted.
  // A buffer named by the sink holds garbage when the verdict is not kOk.
  Verdict Open(const Msg& sealed_header, Msg* payload, FrameHeader* h,
               const PlainSink* sink = nullptr, bool* delivered = nullptr);

 private:
  friend class LinkHandshake;
  void Wipe();
  // The next message's counter (throws before the handshake, or once the
  // counter would reach the form bit).
  uint64_t NextCounter();
  // The sealed header frame: the counter (its top bit set when `extra`, a
  // shared payload's key, comes along), the payload's slice tags, then the
  // header and `extra` encrypted under nonce (counter, 0).
  Msg SealHeader(uint64_t counter, const FrameHeader& h, const std::string& tags,
                 const unsigned char* extra, size_t extra_bytes);

  uint8_t suite_ = 0;
  unsigned char tx_[kLinkKeyBytes] = {};
  unsigned char rx_[kLinkKeyBytes] = {};
  uint64_t sent_ = 0;      // the last counter sealed
  uint64_t received_ = 0;  // the last counter accepted
};

// The handshake of one link: the connecting end makes Hello() and reads the
// answer with Finish(); the listening end answers with Answer().
class LinkHandshake {
 public:
  // link_key: the job's 32-byte link key (derived from the token).
  explicit LinkHandshake(const std::string& link_key);
  ~LinkHandshake();
  LinkHandshake(const LinkHandshake&) = delete;
  LinkHandshake& operator=(const LinkHandshake&) = delete;

  Msg Hello();
  // False (*why says why) if the answer is not one to this hello from a
  // holder of the link key.
  bool Finish(const Msg& answer, LinkCipher* out, std::string* why);
  // False (*why) for a hello not made with the link key, or one offering no
  // AEAD this end runs.
  static bool Answer(const std::string& link_key, const Msg& hello, Msg* answer,
                     LinkCipher* out, std::string* why);

 private:
  std::string key_;
  std::string hello_;  // the first 40 bytes of what Hello() sent
  unsigned char pk_[32] = {}, sk_[32] = {};
};

}  // namespace bps

#endif  // BPS_TF_CORE_TRANSPORT_LINK_CIPHER_H_
