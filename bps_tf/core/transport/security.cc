#include "transport/security.h"

#include <atomic>
#include <cstdio>
#include <cstring>

#include "transport/curve_check.h"
#include "transport/link_cipher.h"

namespace bps {

namespace {

constexpr char kZapEndpoint[] = "inproc://zeromq.zap.01";  // fixed by RFC 27
constexpr char kZapDomain[] = "bps_tf";
constexpr char kLocalZapDomain[] = "bps_tf-local";
constexpr char kPlainUser[] = "bps_tf";
// What a sealed link's connecting end presents to the PLAIN gate: a public
// label, not a secret (bps_tf/runtime/security.py SEALED_GATE), and the
// gate admits any PLAIN hello: the link's handshake behind it is what
// admits a node (link_cipher.h). A credential derived from the token alone,
// sent in clear, would let whoever records it test guesses of the token
// offline; past the gate, a node of another release or token is refused by
// the handshake, which names the cause to both ends.
constexpr char kSealedGate[] = "bps_tf sealed links v4";
constexpr size_t kZ85KeyLen = 40;

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string HexSetting(const Config& cfg, const std::string& key) {
  std::string hex = cfg.Get(key);
  bool ok = hex.size() == 64;
  for (char c : hex) ok = ok && HexDigit(c) >= 0;
  if (!ok) {
    throw Error("the core's config needs " + key +
                " as 64 hex digits (bps_tf/runtime/security.py derives it from BYTEPS_JOB_TOKEN)");
  }
  return hex;
}

std::string Z85(const unsigned char* bytes32) {
  char text[kZ85KeyLen + 1];
  if (!zmq_z85_encode(text, bytes32, 32)) throw Error(ZmqError("encoding a CURVE key"));
  return std::string(text, kZ85KeyLen);
}

std::string RawKey(const std::string& hex) {
  std::string raw(32, '\0');
  for (size_t i = 0; i < 32; ++i) {
    raw[i] = static_cast<char>(HexDigit(hex[2 * i]) * 16 + HexDigit(hex[2 * i + 1]));
  }
  return raw;
}

// A secret key (hex) as z85, and its public key computed by libzmq.
void KeyPair(const Config& cfg, const std::string& key, std::string* secret, std::string* pub) {
  std::string raw = RawKey(HexSetting(cfg, key));
  *secret = Z85(reinterpret_cast<const unsigned char*>(raw.data()));
  char text[kZ85KeyLen + 1];
  if (zmq_curve_public(text, secret->c_str()) != 0) {
    throw Error(ZmqError("computing a CURVE public key"));
  }
  *pub = std::string(text, kZ85KeyLen);
}

void SetOption(void* socket, int option, const std::string& value, const char* what) {
  if (zmq_setsockopt(socket, option, value.data(), value.size()) != 0) {
    throw Error(ZmqError(std::string("setting the socket's ") + what));
  }
}

void SetFlag(void* socket, int option, const char* what) {
  int one = 1;
  if (zmq_setsockopt(socket, option, &one, sizeof(one)) != 0) {
    throw Error(ZmqError(std::string("setting the socket's ") + what));
  }
}

// Compares without an early exit, so the time taken says nothing about
// how much of a guessed credential was right.
bool SameBytes(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

const char kFixSettings[] =
    "set BYTEPS_JOB_TOKEN and BYTEPS_ENCRYPTION the same on every node of the job";

}  // namespace

LinkSecurity LinkSecurity::FromConfig(const Config& cfg) {
  LinkSecurity s;
  std::string mode = cfg.Get("link_security", "none");
  if (mode == "none") return s;
  // Without one (a config made by hand) local links keep the job's security.
  if (cfg.Has("local_credential")) {
    s.local_credential = HexSetting(cfg, "local_credential");
  }
  if (mode == "plain" || mode == "aead") {
    s.mode = mode == "plain" ? Mode::kPlain : Mode::kAead;
    s.credential = s.mode == Mode::kAead ? std::string(kSealedGate)
                                         : HexSetting(cfg, "plain_credential");
    if (s.mode == Mode::kAead) {
      s.link_key = RawKey(HexSetting(cfg, "link_key"));
      if (!SodiumMissing().empty()) throw Error(SodiumMissing());
      // Once per process: which library and AEAD its TCP links are sealed with.
      static const bool said = [] {
        BPS_LOG(kInfo, "sealed links (BYTEPS_ENCRYPTION=1): " << SodiumDescribe());
        return true;
      }();
      (void)said;
    }
    return s;
  }
  if (mode != "curve") {
    throw Error("link_security must be none, plain, aead or curve, not '" + mode + "'");
  }
  if (!zmq_has("curve")) {
    throw Error(
        "BYTEPS_JOB_TOKEN is set and BYTEPS_ENCRYPTION=curve, but the libzmq this process "
        "loaded has no CURVE support; set BYTEPS_ENCRYPTION=1 on every node (sealed links, "
        "on libsodium), use pyzmq's wheel (its libzmq has CURVE), or set "
        "BYTEPS_ENCRYPTION=0 on every node inside a trusted network");
  }
  s.mode = Mode::kCurve;
  const std::string slow = CurveSlowWarning();
  if (!slow.empty()) BPS_LOG(kWarning, slow);
  KeyPair(cfg, "curve_server_secret", &s.server_secret, &s.server_public);
  KeyPair(cfg, "curve_client_secret", &s.client_secret, &s.client_public);
  return s;
}

LinkSecurity LinkSecurity::ForLocalLinks() const {
  LinkSecurity s = *this;
  s.local = true;
  if (mode != Mode::kNone && !local_credential.empty()) {
    s.mode = Mode::kPlain;
    s.credential = local_credential;
  }
  return s;
}

void LinkSecurity::ApplyClient(void* socket) const {
  if (mode == Mode::kCurve) {
    SetOption(socket, zmqc::kCurveServerKey, server_public, "CURVE server key");
    SetOption(socket, zmqc::kCurvePublicKey, client_public, "CURVE public key");
    SetOption(socket, zmqc::kCurveSecretKey, client_secret, "CURVE secret key");
  } else if (mode == Mode::kPlain || mode == Mode::kAead) {
    SetOption(socket, zmqc::kPlainUsername, kPlainUser, "PLAIN user name");
    SetOption(socket, zmqc::kPlainPassword, credential, "PLAIN password");
  }
}

void LinkSecurity::ApplyServer(void* socket) const {
  if (mode == Mode::kNone) return;
  if (mode == Mode::kCurve) {
    SetFlag(socket, zmqc::kCurveServer, "CURVE server role");
    SetOption(socket, zmqc::kCurvePublicKey, server_public, "CURVE public key");
    SetOption(socket, zmqc::kCurveSecretKey, server_secret, "CURVE secret key");
  } else {
    SetFlag(socket, zmqc::kPlainServer, "PLAIN server role");
  }
  SetOption(socket, zmqc::kZapDomain, local ? kLocalZapDomain : kZapDomain, "ZAP domain");
}

bool LinkSecurity::Admits(const std::string& mechanism, const std::string* credentials,
                          int count) const {
  switch (mode) {
    case Mode::kNone:
      return true;
    case Mode::kPlain:
      return mechanism == "PLAIN" && count == 2 && SameBytes(credentials[1], credential);
    case Mode::kAead:  // the handshake admits (kSealedGate)
      return mechanism == "PLAIN" && count == 2;
    case Mode::kCurve:
      return mechanism == "CURVE" && count == 1 && credentials[0].size() == 32 &&
             SameBytes(Z85(reinterpret_cast<const unsigned char*>(credentials[0].data())),
                       client_public);
  }
  return false;
}

std::string LinkSecurity::Describe() const {
  if (local && mode == Mode::kPlain && credential == local_credential) {
    return "a token credential on Unix sockets to this machine's peers, not encrypted "
           "(BYTEPS_JOB_TOKEN set, BYTEPS_ENABLE_IPC=1)";
  }
  switch (mode) {
    case Mode::kNone:
      return "no authentication and no encryption (BYTEPS_JOB_TOKEN is not set)";
    case Mode::kPlain:
      return "a token credential without encryption (BYTEPS_JOB_TOKEN set, BYTEPS_ENCRYPTION=0)";
    case Mode::kCurve:
      return "ZeroMQ CURVE encryption (BYTEPS_JOB_TOKEN set, BYTEPS_ENCRYPTION=curve)";
    case Mode::kAead:
      return "encryption (BYTEPS_JOB_TOKEN set, BYTEPS_ENCRYPTION=1)";
  }
  return "?";
}

std::string ExplainRefusal(const std::string& endpoint, const std::string& theirs,
                           const LinkSecurity& security) {
  return "the connection to " + endpoint + " was refused: the other end uses " + theirs +
         "; this node uses " + security.Describe() + "; " + kFixSettings;
}

std::string RejectionCause(bool replayed) {
  return replayed ? "came again or out of order (replayed or reordered on the way)"
                  : "failed authentication (changed on the way, or forged)";
}

std::string ExplainRejected(const std::string& endpoint, bool replayed) {
  return "a message from " + endpoint + " " + RejectionCause(replayed) +
         ": the link to it cannot be trusted, so this node stops rather than lose or accept it";
}

std::string ExplainRejectedFromPeer(const std::string& endpoint, bool replayed) {
  return "the other end (" + endpoint + ") rejected a message of this node: it " +
         RejectionCause(replayed) +
         "; the link cannot be trusted, so this node stops rather than lose or accept it";
}

bool HandshakeEvent::connection() const {
  return event == zmqc::kEventConnected || event == zmqc::kEventAccepted;
}

bool HandshakeEvent::closed() const { return event == zmqc::kEventClosed; }

bool HandshakeEvent::dropped() const { return event == zmqc::kEventDisconnected; }

bool HandshakeEvent::failed() const {
  return !connection() && !closed() && !dropped() && event != zmqc::kEventHandshakeSucceeded;
}

bool HandshakeEvent::definitive() const {
  return event == zmqc::kEventHandshakeFailedAuth ||
         (event == zmqc::kEventHandshakeFailedProtocol &&
          value == static_cast<uint32_t>(zmqc::kProtocolErrorMechanismMismatch));
}

std::string ExplainHandshakeFailure(const HandshakeEvent& e, const LinkSecurity& security,
                                    bool outgoing) {
  const std::string mine = "this node uses " + security.Describe();
  if (e.event == zmqc::kEventHandshakeFailedAuth) {
    std::string code = std::to_string(e.value);
    if (!outgoing) {
      return "refused a peer's credentials (status " + code +
             "): another BYTEPS_JOB_TOKEN, or not a process of this job";
    }
    // A sealed link's gate admits any PLAIN hello (kSealedGate), so a gate
    // that refuses this node's label checks a token credential instead.
    const std::string cause =
        security.sealed()
            ? "it does not run sealed links (v4): it uses BYTEPS_ENCRYPTION=0 and checks a "
              "token credential this node never sends, or it is a bps_tf release before the "
              "v4 handshake"
            : "it holds another BYTEPS_JOB_TOKEN";
    return "the other end refused this node's credentials (status " + code + "): " + cause +
           "; " + mine + "; " + kFixSettings;
  }
  if (e.event == zmqc::kEventHandshakeFailedProtocol) {
    if (e.value == static_cast<uint32_t>(zmqc::kProtocolErrorMechanismMismatch)) {
      return (outgoing ? "the other end does not use the same security: "
                       : "a peer does not use the same security: ") +
             mine + "; " + kFixSettings;
    }
    if (e.value == static_cast<uint32_t>(zmqc::kProtocolErrorCryptographic)) {
      return outgoing ? "the other end's handshake could not be decrypted: it holds another "
                        "BYTEPS_JOB_TOKEN; " + std::string(kFixSettings)
                      : "a peer's handshake could not be decrypted: another "
                        "BYTEPS_JOB_TOKEN, or not a process of this job";
    }
    char code[16];
    snprintf(code, sizeof(code), "0x%08x", e.value);
    return std::string(outgoing ? "the other end" : "a peer") +
           " broke the ZeroMQ handshake (protocol error " + code +
           "): not a bps_tf process of this version?";
  }
  std::string why = zmq_strerror(static_cast<int>(e.value));
  if (!outgoing) return "a peer left during the handshake (" + why + ")";
  std::string cause = security.mode == LinkSecurity::Mode::kCurve
                          ? "it could not decrypt this node's hello, so it holds another "
                            "BYTEPS_JOB_TOKEN or uses no encryption"
                          : "it uses other security settings";
  return "the other end closed the connection during the handshake (" + why + "): " + cause +
         "; " + mine + "; " + kFixSettings;
}

HandshakeWatch::HandshakeWatch(Context& ctx, Socket* watched, bool drops)
    : watched_(watched), pair_(ctx, zmqc::kPair) {
  static std::atomic<uint64_t> next{0};
  std::string name = "inproc://bps-handshake-" + std::to_string(next++);
  int events = zmqc::kEventHandshakeFailedNoDetail | zmqc::kEventHandshakeSucceeded |
               zmqc::kEventHandshakeFailedProtocol | zmqc::kEventHandshakeFailedAuth |
               zmqc::kEventConnected | zmqc::kEventAccepted | zmqc::kEventClosed |
               (drops ? zmqc::kEventDisconnected : 0);
  if (zmq_socket_monitor(watched_->get(), name.c_str(), events) != 0) {
    throw Error(ZmqError("watching a socket's handshakes"));
  }
  pair_.Connect(name);
}

HandshakeWatch::~HandshakeWatch() { zmq_socket_monitor(watched_->get(), nullptr, 0); }

bool HandshakeWatch::Next(HandshakeEvent* e) {
  // [uint16 event, uint32 value] [endpoint], in the host's byte order.
  while (pair_.RecvFrames(&frames_)) {
    if (frames_.empty() || frames_[0].size() != 6) continue;
    uint16_t event;
    std::memcpy(&event, frames_[0].data(), 2);
    std::memcpy(&e->value, frames_[0].data() + 2, 4);
    e->event = event;
    return true;
  }
  return false;
}

ZapHandler::ZapHandler(Context& ctx, const LinkSecurity& network, const LinkSecurity& local)
    : network_(network), local_(local), sock_(ctx, zmqc::kRep) {
  sock_.Bind(kZapEndpoint);
}

void ZapHandler::Serve() {
  // Request: version, request id, domain, address, identity, mechanism,
  // credentials...; reply: version, request id, status, text, user, metadata.
  while (sock_.RecvFrames(&frames_)) {
    bool ok = false;
    std::string request_id;
    if (frames_.size() >= 6) {
      request_id = frames_[1].str();
      std::vector<std::string> credentials;
      for (size_t i = 6; i < frames_.size(); ++i) credentials.push_back(frames_[i].str());
      const std::string domain = frames_[2].str();
      const LinkSecurity* security = domain == kZapDomain        ? &network_
                                     : domain == kLocalZapDomain ? &local_
                                                                 : nullptr;
      ok = frames_[0].str() == "1.0" && security &&
           security->Admits(frames_[5].str(), credentials.data(),
                            static_cast<int>(credentials.size()));
    }
    std::vector<Msg> reply;
    const std::string status = ok ? "200" : "400";
    const std::string text = ok ? "OK" : "not a process of this job";
    reply.emplace_back("1.0", 3);
    reply.emplace_back(request_id.data(), request_id.size());
    reply.emplace_back(status.data(), status.size());
    reply.emplace_back(text.data(), text.size());
    reply.emplace_back();
    reply.emplace_back();
    sock_.SendFrames(&reply);
  }
}

}  // namespace bps
