#include "transport/link_cipher.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "common/common.h"
#include "common/stats.h"
#include "transport/aead_suites.h"
#include "transport/cipher_pool.h"

namespace bps {

namespace {

constexpr char kHandshakeMagic[] = "BPSK";
constexpr char kRefusalMagic[] = "BPSR";
constexpr size_t kMagicBytes = 4;
// 2: payloads sealed in slices (one tag each). A node of the release before
// would read a sliced message as forged; the version makes both ends refuse
// at the handshake instead, naming another release as the cause.
// 3: payloads encrypted once for several links (the counter's top bit).
// 4: the link key comes from a slow derivation of the token (scrypt), and
// the PLAIN gate in front of the handshake presents a public label instead
// of a credential derived from the token (security.cc kSealedGate).
constexpr uint8_t kHandshakeVersion = 4;
// Set in a message's stored counter when its payload is a SharedSeal's.
constexpr uint64_t kSharedPayload = uint64_t{1} << 63;
constexpr uint8_t kHelloRole = 1, kAnswerRole = 2;
constexpr size_t kPublicBytes = 32;
constexpr size_t kMacBytes = 32;
// magic, version, role, suites (uint16), public key: what the MACs cover.
constexpr size_t kSignedBytes = kMagicBytes + 2 + 2 + kPublicBytes;
constexpr size_t kHandshakeBytes = kSignedBytes + kMacBytes;
constexpr size_t kMaxRefusalText = 1024;

void StoreCounter(uint64_t v, unsigned char* out) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<unsigned char>(v >> (8 * i));
}

uint64_t LoadCounter(const unsigned char* in) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(in[i]) << (8 * i);
  return v;
}

// (counter, part): part 0 seals a header, 1 + i slice i of its payload; the
// rest is zero.
void Nonce(uint64_t counter, uint8_t part, size_t size, unsigned char* out) {
  std::memset(out, 0, size);
  StoreCounter(counter, out);
  out[8] = part;
}

// Keyed BLAKE2b of label || data, `size` bytes (32 unless told): the
// handshake's MAC and key derivation.
void KeyedHash(const std::string& key, const char* label, const std::string& data,
               unsigned char* out, size_t size = 32) {
  std::string msg = std::string(label) + '\0' + data;
  Lib().api.generichash(out, size, reinterpret_cast<const unsigned char*>(msg.data()), msg.size(),
                     reinterpret_cast<const unsigned char*>(key.data()), key.size());
  Wipe(&msg[0], msg.size());
}

std::string Signed(uint8_t role, uint16_t suites, const unsigned char* pk) {
  std::string s(kHandshakeMagic, kMagicBytes);
  s += static_cast<char>(kHandshakeVersion);
  s += static_cast<char>(role);
  s += static_cast<char>(suites & 0xff);
  s += static_cast<char>(suites >> 8);
  s.append(reinterpret_cast<const char*>(pk), kPublicBytes);
  return s;
}

// The signed part of a handshake record of `role`, if its MAC (computed by
// `mac`) verifies; else why not.
std::string CheckRecord(const Msg& m, uint8_t role, const std::string& key, const char* label,
                        const std::string& also_covered, std::string* signed_part) {
  if (!IsHandshakeRecord(m)) return "not a handshake record";
  const char* d = m.data();
  if (static_cast<uint8_t>(d[4]) != kHandshakeVersion) {
    return "handshake version " + std::to_string(static_cast<uint8_t>(d[4])) + " (this node speaks " +
           std::to_string(kHandshakeVersion) + "): a bps_tf of another release; run one release "
           "on every node";
  }
  if (static_cast<uint8_t>(d[5]) != role) return "an unexpected handshake record";
  *signed_part = std::string(d, kSignedBytes);
  unsigned char mac[kMacBytes];
  KeyedHash(key, label, *signed_part + also_covered, mac);
  if (Lib().api.verify_32(mac, reinterpret_cast<const unsigned char*>(d + kSignedBytes)) != 0) {
    return "its MAC does not verify: it holds another BYTEPS_JOB_TOKEN, or is not a process of "
           "this job";
  }
  return "";
}

uint16_t SuitesOf(const std::string& signed_part) {
  return static_cast<uint16_t>(static_cast<uint8_t>(signed_part[6]) |
                               (static_cast<uint8_t>(signed_part[7]) << 8));
}

const unsigned char* PublicOf(const std::string& signed_part) {
  return reinterpret_cast<const unsigned char*>(signed_part.data()) + 8;
}

Msg Record(const std::string& key, const char* label, const std::string& signed_part,
           const std::string& also_covered) {
  unsigned char mac[kMacBytes];
  KeyedHash(key, label, signed_part + also_covered, mac);
  std::string out = signed_part + std::string(reinterpret_cast<char*>(mac), kMacBytes);
  return Msg(out.data(), out.size());
}

// The link's key for one direction, as long as the suite's: the link key
// over crypto_kx's key for that direction and the transcript (both
// records' signed parts, which name the suite).
void DirectionKey(const std::string& key, const char* label, const unsigned char* kx_key,
                  const std::string& transcript, size_t size, unsigned char* out) {
  std::string data(reinterpret_cast<const char*>(kx_key), kLinkKeyBytes);
  KeyedHash(key, label, data + transcript, out, size);
  Wipe(&data[0], data.size());
}

constexpr char kHelloLabel[] = "bps_tf link hello v1";
constexpr char kAnswerLabel[] = "bps_tf link answer v1";
constexpr char kToServer[] = "bps_tf link key to server v1";
constexpr char kToClient[] = "bps_tf link key to client v1";

// The ciphertext of a payload, holding the plaintext message until libzmq
// releases the ciphertext.
struct Sealed {
  Msg plain;
  char* cipher;
};

// Slices of one payload: each sealed under its own nonce (counter, 1 + i)
// and tag, so several threads can seal or open one message (cipher_pool.h).
// A slice is never under kMinSlice bytes: waking a thread costs microseconds.
constexpr size_t kMinSlice = 256 << 10;
constexpr size_t kMaxSlices = 16;

int SlicesFor(size_t n) {
  const size_t by_size = std::max<size_t>(1, n / kMinSlice);
  return static_cast<int>(std::min({by_size, kMaxSlices, static_cast<size_t>(CipherThreads())}));
}

// Slice i of `slices` over n bytes, cut at 64-byte boundaries; both ends
// compute the same cuts from n and the count alone.
void SliceOf(size_t n, int slices, int i, size_t* begin, size_t* len) {
  const size_t step = ((n + slices - 1) / slices + 63) / 64 * 64;
  *begin = std::min(n, step * static_cast<size_t>(i));
  *len = i + 1 == slices ? n - *begin : std::min(n, *begin + step) - *begin;
}

void FreeSealed(void*, void* hint) {
  Sealed* s = static_cast<Sealed*>(hint);
  delete[] s->cipher;
  delete s;
}

// Encrypts n bytes of `plain` to `cipher` in the slices SlicesFor(n) picks,
// slice i under `key` and nonce (counter, 1 + i); returns their tags. An
// empty payload is one empty slice: its tag still binds it.
std::string SealSlices(const SuiteOps& ops, const unsigned char* key, uint64_t counter,
                       const char* plain, char* cipher, size_t n) {
  const size_t ab = ops.abytes;
  const int slices = SlicesFor(n);
  std::string tags(slices * ab, '\0');
  unsigned char* t = reinterpret_cast<unsigned char*>(&tags[0]);
  unsigned char none = 0;
  const unsigned char* p = n ? reinterpret_cast<const unsigned char*>(plain) : &none;
  unsigned char* c = n ? reinterpret_cast<unsigned char*>(cipher) : &none;
  RunSlices(slices, [&](int i) {
    size_t begin, len;
    SliceOf(n, slices, i, &begin, &len);
    unsigned char nonce[kMaxNonce];
    Nonce(counter, static_cast<uint8_t>(1 + i), ops.npub, nonce);
    ops.encrypt(c + begin, t + i * ab, nullptr, p + begin, len, nullptr, 0, nullptr, nonce, key);
  });
  if (slices > 1) Stats::Get().messages_sealed_in_slices++;
  return tags;
}

}  // namespace

// One link's hold on a shared ciphertext, and on the plaintext that link
// would have sent (whose free function may report something, a credit).
struct SharedRef {
  std::shared_ptr<SharedSeal> seal;
  Msg keep;
};

namespace {

void FreeSharedRef(void*, void* hint) { delete static_cast<SharedRef*>(hint); }

}  // namespace

bool IsHandshakeRecord(const Msg& m) {
  return m.size() == kHandshakeBytes && std::memcmp(m.data(), kHandshakeMagic, kMagicBytes) == 0;
}

bool IsRefusalRecord(const Msg& m) {
  return m.size() >= kMagicBytes && m.size() <= kMagicBytes + kMaxRefusalText &&
         std::memcmp(m.data(), kRefusalMagic, kMagicBytes) == 0;
}

Msg RefusalRecord(const std::string& security) {
  std::string text = std::string(kRefusalMagic, kMagicBytes) + security.substr(0, kMaxRefusalText);
  return Msg(text.data(), text.size());
}

std::string RefusalText(const Msg& m) {
  std::string out;
  for (size_t i = kMagicBytes; i < m.size(); ++i) {
    char c = m.data()[i];
    out += (c >= 32 && c < 127) ? c : '?';  // printable only: it comes from anyone
  }
  return out;
}

LinkCipher::~LinkCipher() { Wipe(); }

LinkCipher::LinkCipher(LinkCipher&& other) noexcept { *this = std::move(other); }

LinkCipher& LinkCipher::operator=(LinkCipher&& other) noexcept {
  if (this == &other) return *this;
  suite_ = other.suite_;
  std::memcpy(tx_, other.tx_, sizeof(tx_));
  std::memcpy(rx_, other.rx_, sizeof(rx_));
  sent_ = other.sent_;
  received_ = other.received_;
  other.Wipe();
  return *this;
}

void LinkCipher::Wipe() {
  bps::Wipe(tx_, sizeof(tx_));
  bps::Wipe(rx_, sizeof(rx_));
  suite_ = 0;
}

Msg LinkCipher::SealHeader(uint64_t counter, const FrameHeader& h, const std::string& tags,
                           const unsigned char* extra, size_t extra_bytes) {
  const SuiteOps* ops = OpsOf(suite_);
  const size_t ab = ops->abytes, plain_bytes = sizeof(FrameHeader) + extra_bytes;
  // counter, one tag per payload slice, header (and extra), header tag
  Msg head(8 + tags.size() + plain_bytes + ab);
  unsigned char* a = reinterpret_cast<unsigned char*>(head.data());
  StoreCounter(counter | (extra_bytes ? kSharedPayload : 0), a);
  std::memcpy(a + 8, tags.data(), tags.size());
  unsigned char plain[sizeof(FrameHeader) + kLinkKeyBytes];
  std::memcpy(plain, &h, sizeof(FrameHeader));
  if (extra_bytes) std::memcpy(plain + sizeof(FrameHeader), extra, extra_bytes);
  unsigned char nonce[kMaxNonce];
  Nonce(counter, 0, ops->npub, nonce);
  const size_t ad = 8 + tags.size();  // the counter and every slice's tag
  unsigned char* sealed = a + ad;
  ops->encrypt(sealed, sealed + plain_bytes, nullptr, plain, plain_bytes, a, ad, nullptr, nonce,
               tx_);
  bps::Wipe(plain, sizeof(plain));
  return head;
}

uint64_t LinkCipher::NextCounter() {
  if (!OpsOf(suite_)) throw Error("sealing a message on a link whose handshake is not done");
  // 2^63 messages would take centuries; refusing beats reusing a nonce.
  if (sent_ + 1 >= kSharedPayload) throw Error("a link's message counter is exhausted");
  return ++sent_;
}

void LinkCipher::Seal(const FrameHeader& h, Msg&& payload, std::vector<Msg>* frames) {
  const uint64_t counter = NextCounter();
  const size_t n = payload.size();
  Sealed* s = n ? new Sealed{std::move(payload), new char[n]} : nullptr;
  const std::string tags = SealSlices(*OpsOf(suite_), tx_, counter, s ? s->plain.data() : nullptr,
                                      s ? s->cipher : nullptr, n);
  frames->push_back(SealHeader(counter, h, tags, nullptr, 0));
  frames->push_back(s ? Msg(s->cipher, n, &FreeSealed, s) : Msg());
}

SharedSeal::SharedSeal(Suite suite, const Msg& plain) : suite_(suite), size_(plain.size()) {
  const SuiteOps* ops = OpsOf(static_cast<uint8_t>(suite));
  if (!ops) throw Error("sealing a payload with an AEAD this node does not run");
  // A key of its own for every payload: it seals nothing else, so the
  // fixed nonces (0, 1 + i) never repeat under it.
  Lib().api.randombytes_buf(key_, ops->key);
  if (size_) cipher_ = new char[size_];
  tags_ = SealSlices(*ops, key_, 0, plain.data(), cipher_, size_);
}

SharedSeal::~SharedSeal() {
  bps::Wipe(key_, sizeof(key_));
  delete[] cipher_;
}

void LinkCipher::SealShared(const FrameHeader& h, const std::shared_ptr<SharedSeal>& payload,
                            Msg&& keep, std::vector<Msg>* frames) {
  // Checked before NextCounter, as before the cleanup: a refused message
  // takes no counter.
  if (OpsOf(suite_) && payload->suite() != suite()) {
    throw Error("a shared payload sealed with another AEAD");
  }
  const uint64_t counter = NextCounter();
  frames->push_back(SealHeader(counter, h, payload->tags_, payload->key_, OpsOf(suite_)->key));
  const size_t n = payload->size();
  if (n) {
    auto* ref = new SharedRef{payload, std::move(keep)};
    frames->push_back(Msg(payload->cipher_, n, &FreeSharedRef, ref));
  } else {
    frames->push_back(Msg());
  }
  Stats::Get().messages_sealed_shared++;
}

LinkCipher::Verdict LinkCipher::Open(const Msg& sealed_header, Msg* payload, FrameHeader* h,
                                     const PlainSink* sink, bool* delivered) {
  if (delivered) *delivered = false;
  const SuiteOps* ops = OpsOf(suite_);
  if (!ops) return Verdict::kForged;
  const size_t ab = ops->abytes, n = payload->size();
  if (sealed_header.size() < 8) return Verdict::kForged;
  const unsigned char* a = reinterpret_cast<const unsigned char*>(sealed_header.data());
  // The form (the top bit) is covered by the header's tag like the rest.
  const uint64_t stored = LoadCounter(a);
  const bool shared = (stored & kSharedPayload) != 0;
  const uint64_t counter = stored & ~kSharedPayload;
  const size_t plain_bytes = sizeof(FrameHeader) + (shared ? ops->key : 0);
  // The sender chose the slices; their tags say how many, and the header's
  // tag covers them all, so the count cannot be changed on the way.
  const size_t fixed = 8 + plain_bytes + ab;
  if (sealed_header.size() < fixed + ab || (sealed_header.size() - fixed) % ab != 0) {
    return Verdict::kForged;
  }
  const size_t slices = (sealed_header.size() - fixed) / ab;
  if (slices > kMaxSlices || (n == 0 && slices != 1)) return Verdict::kForged;
  unsigned char nonce[kMaxNonce];
  Nonce(counter, 0, ops->npub, nonce);
  unsigned char plain[sizeof(FrameHeader) + kLinkKeyBytes];
  const size_t ad = 8 + slices * ab;
  const unsigned char* sealed = a + ad;
  if (ops->decrypt(plain, nullptr, sealed, plain_bytes, sealed + plain_bytes, a, ad, nonce,
                   rx_) != 0) {
    return Verdict::kForged;
  }
  // Authentic, so this end's peer sealed it: an old counter means the
  // message came again or out of order, never a new one.
  if (counter <= received_) {
    bps::Wipe(plain, sizeof(plain));
    return Verdict::kReplayed;
  }
  FrameHeader header;
  std::memcpy(&header, plain, sizeof(header));
  const unsigned char* key = shared ? plain + sizeof(FrameHeader) : rx_;
  const uint64_t slice_counter = shared ? 0 : counter;
  unsigned char none = 0;
  unsigned char* p = n ? reinterpret_cast<unsigned char*>(payload->data()) : &none;
  char* dest = n && sink && *sink ? (*sink)(header, n) : nullptr;
  unsigned char* out = dest ? reinterpret_cast<unsigned char*>(dest) : p;
  std::atomic<bool> ok{true};
  const int count = static_cast<int>(slices);
  RunSlices(count, [&](int i) {
    size_t begin, len;
    SliceOf(n, count, i, &begin, &len);
    unsigned char slice_nonce[kMaxNonce];
    Nonce(slice_counter, static_cast<uint8_t>(1 + i), ops->npub, slice_nonce);
    if (ops->decrypt(out + begin, nullptr, p + begin, len, a + 8 + i * ab, nullptr, 0,
                     slice_nonce, key) != 0) {
      ok = false;
    }
  });
  bps::Wipe(plain, sizeof(plain));
  if (!ok) return Verdict::kForged;
  received_ = counter;
  std::memcpy(h, &header, sizeof(header));
  if (delivered) *delivered = dest != nullptr;
  if (shared) Stats::Get().messages_opened_shared++;
  return Verdict::kOk;
}

LinkHandshake::LinkHandshake(const std::string& link_key) : key_(link_key) {}

LinkHandshake::~LinkHandshake() {
  Wipe(sk_, sizeof(sk_));
  if (!key_.empty()) Wipe(&key_[0], key_.size());
}

Msg LinkHandshake::Hello() {
  if (!SodiumMissing().empty()) throw Error(SodiumMissing());
  Lib().api.kx_keypair(pk_, sk_);
  hello_ = Signed(kHelloRole, OfferedSuites(), pk_);
  return Record(key_, kHelloLabel, hello_, "");
}

bool LinkHandshake::Finish(const Msg& answer, LinkCipher* out, std::string* why) {
  std::string signed_part;
  *why = CheckRecord(answer, kAnswerRole, key_, kAnswerLabel, hello_, &signed_part);
  if (!why->empty()) return false;
  const uint16_t chosen = SuitesOf(signed_part);
  const SuiteOps* ops = nullptr;
  for (const SuiteOps& s : Lib().suites) {
    if (chosen == (1u << static_cast<int>(s.id))) ops = &s;
  }
  if (!ops) {
    *why = "the other end chose an AEAD this node did not offer";
    return false;
  }
  unsigned char rx[kLinkKeyBytes], tx[kLinkKeyBytes];
  if (Lib().api.kx_client_session_keys(rx, tx, pk_, sk_, PublicOf(signed_part)) != 0) {
    *why = "the other end's key is not a valid X25519 key";
    return false;
  }
  const std::string transcript = hello_ + signed_part;
  DirectionKey(key_, kToServer, tx, transcript, ops->key, out->tx_);
  DirectionKey(key_, kToClient, rx, transcript, ops->key, out->rx_);
  Wipe(rx, sizeof(rx));
  Wipe(tx, sizeof(tx));
  Wipe(sk_, sizeof(sk_));
  out->suite_ = static_cast<uint8_t>(ops->id);
  out->sent_ = out->received_ = 0;
  return true;
}

bool LinkHandshake::Answer(const std::string& link_key, const Msg& hello, Msg* answer,
                           LinkCipher* out, std::string* why) {
  if (!SodiumMissing().empty()) {
    *why = SodiumMissing();
    return false;
  }
  std::string hello_part;
  *why = CheckRecord(hello, kHelloRole, link_key, kHelloLabel, "", &hello_part);
  if (!why->empty()) return false;
  const uint16_t offered = SuitesOf(hello_part);
  const SuiteOps* ops = nullptr;
  for (const SuiteOps& s : Lib().suites) {
    if (!ops && (offered & (1u << static_cast<int>(s.id)))) ops = &s;
  }
  if (!ops) {
    *why = "it offers no AEAD this node runs (" + SodiumDescribe() + ")";
    return false;
  }
  unsigned char pk[kPublicBytes], sk[32], rx[kLinkKeyBytes], tx[kLinkKeyBytes];
  Lib().api.kx_keypair(pk, sk);
  bool ok = Lib().api.kx_server_session_keys(rx, tx, pk, sk, PublicOf(hello_part)) == 0;
  Wipe(sk, sizeof(sk));
  if (!ok) {
    *why = "its key is not a valid X25519 key";
    return false;
  }
  const std::string answer_part =
      Signed(kAnswerRole, static_cast<uint16_t>(1u << static_cast<int>(ops->id)), pk);
  *answer = Record(link_key, kAnswerLabel, answer_part, hello_part);
  const std::string transcript = hello_part + answer_part;
  DirectionKey(link_key, kToClient, tx, transcript, ops->key, out->tx_);
  DirectionKey(link_key, kToServer, rx, transcript, ops->key, out->rx_);
  Wipe(rx, sizeof(rx));
  Wipe(tx, sizeof(tx));
  out->suite_ = static_cast<uint8_t>(ops->id);
  out->sent_ = out->received_ = 0;
  return true;
}

}  // namespace bps
