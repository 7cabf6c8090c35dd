// Who may connect, and whether the bytes are encrypted: done by libzmq, per
// connection, with the mechanisms ZeroMQ specifies (ZMTP CURVE and PLAIN,
// authentication requests over ZAP), never by code of ours.
//
// Four modes, chosen by bps_tf/runtime/security.py from BYTEPS_JOB_TOKEN and
// BYTEPS_ENCRYPTION, which derives every secret below from the token:
//   aead   (BYTEPS_ENCRYPTION=1, the default) libzmq checks the PLAIN
//          gate, a public label that names the handshake (no secret: an
//          older release is refused by name); every message is then sealed by
//          link_cipher.h (a handshake keyed by the token, an AEAD from
//          libsodium per message): encrypted, authenticated both ways, and
//          neither replayable nor reorderable (its cost against CURVE's:
//          docs/performance.md#encryption).
//   curve  (BYTEPS_ENCRYPTION=curve) every link is CURVE: encrypted and
//          authenticated both ways. The
//          listening side holds the server key pair; connecting sides the
//          client key pair; a ZAP handler admits only that client key, so
//          knowing the server's public key is not enough to connect.
//   plain  no encryption; a connecting side presents a credential derived
//          from the token (PLAIN, in clear), checked by the same ZAP handler:
//          it keeps jobs apart, not an eavesdropper out.
//   none   no token: anyone who reaches the port is let in.
// Links over Unix sockets (ipc://, between processes of one machine) use
// ForLocalLinks(): with a token they present a credential of their own
// (local_credential, PLAIN), authenticated but not encrypted. No network
// carries their bytes, and a process able to read them (root on that
// machine) could as well read the memory of the processes at either end;
// CURVE would only cost time (3x at 64 MiB: docs/performance-history.md,
// "Unix sockets on one machine").
// The listening side is not authenticated by PLAIN: channel.cc never
// reconnects a local link, so a process that takes a dead server's name
// gets no credential.
#ifndef BPS_TF_CORE_TRANSPORT_SECURITY_H_
#define BPS_TF_CORE_TRANSPORT_SECURITY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/common.h"
#include "transport/transport.h"

namespace bps {

struct LinkSecurity {
  enum class Mode { kNone, kPlain, kCurve, kAead };
  Mode mode = Mode::kNone;
  std::string server_public, server_secret;  // z85, 40 characters (curve)
  std::string client_public, client_secret;  // z85 (curve)
  std::string credential;                    // the PLAIN password (plain; aead: the label)
  std::string link_key;                      // 32 raw bytes: link_cipher.h's key (aead)
  std::string local_credential;              // the PLAIN password of local links
  bool local = false;                        // for ipc:// links (own ZAP domain)

  // From the config text's link_security, curve_server_secret,
  // curve_client_secret, plain_credential, link_key and local_credential
  // (64 hex digits each). Throws Error when they are missing or malformed,
  // or this libzmq has no CURVE (curve), or no libsodium is loaded (aead).
  static LinkSecurity FromConfig(const Config& cfg);
  // The security of this node's Unix-socket links (see the top).
  LinkSecurity ForLocalLinks() const;
  // Whether messages are sealed by link_cipher.h (aead, never local).
  bool sealed() const { return mode == Mode::kAead && !local; }

  void ApplyClient(void* socket) const;  // before zmq_connect
  void ApplyServer(void* socket) const;  // before zmq_bind
  // True if a ZAP request's mechanism and credentials are this job's.
  bool Admits(const std::string& mechanism, const std::string* credentials, int count) const;
  // "CURVE (encrypted)", ... and the settings that chose it, for errors.
  std::string Describe() const;
};

// One handshake outcome on a socket, as its monitor reports it.
struct HandshakeEvent {
  int event = 0;       // zmqc::kEventHandshake*, kEventConnected, kEventAccepted,
                       // kEventClosed, kEventDisconnected
  uint32_t value = 0;  // errno, protocol error, ZAP status code or the new connection's fd
  // A new TCP connection (before its handshake), not a handshake outcome.
  bool connection() const;
  // An attempt to connect gave up its socket (not a handshake outcome).
  bool closed() const;
  // A connection that broke after it was up, not a handshake outcome.
  bool dropped() const;
  bool failed() const;
  // A failure retrying cannot cure: a mechanism mismatch or a refusal.
  bool definitive() const;
};

// Why a connection failed its handshake, in the user's terms. `outgoing`:
// this node opened it (else a peer connected to this node).
std::string ExplainHandshakeFailure(const HandshakeEvent& e, const LinkSecurity& security,
                                    bool outgoing);

// A peer's refusal record (link_cipher.h) in the user's terms: the other end
// of `endpoint` uses `theirs`.
std::string ExplainRefusal(const std::string& endpoint, const std::string& theirs,
                           const LinkSecurity& security);
// Why a sealed message was rejected: it did not verify, or (`replayed`) it
// did but came again or out of order.
std::string RejectionCause(bool replayed);
// The same on a link this node opened to `endpoint`, for the user.
std::string ExplainRejected(const std::string& endpoint, bool replayed);
// The same seen by the listening side, sent to the peer (an alert) and logged.
std::string ExplainRejectedFromPeer(const std::string& endpoint, bool replayed);

// The receiving end of one socket's handshake events (zmq_socket_monitor).
// Destroy it before the socket it watches.
class HandshakeWatch {
 public:
  // drops: also report connections that break (kEventDisconnected); for a
  // socket that connects to one peer, whose loss the node must notice.
  HandshakeWatch(Context& ctx, Socket* watched, bool drops = false);
  ~HandshakeWatch();
  HandshakeWatch(const HandshakeWatch&) = delete;
  HandshakeWatch& operator=(const HandshakeWatch&) = delete;

  void* socket() { return pair_.get(); }
  // Takes the next event without blocking; false when none is waiting.
  bool Next(HandshakeEvent* e);

 private:
  Socket* watched_;
  Socket pair_;
  std::vector<Msg> frames_;
};

// Answers libzmq's ZAP requests (RFC 27) for the listening sockets of one
// context: admits this job's client key or credential, refuses the rest. A
// request's ZAP domain says whether it came to a network or a local socket,
// so a PLAIN hello is only admitted on a local one.
class ZapHandler {
 public:
  // Binds the ZAP endpoint.
  ZapHandler(Context& ctx, const LinkSecurity& network, const LinkSecurity& local);

  void* socket() { return sock_.get(); }
  void Serve();  // answers every waiting request without blocking

 private:
  const LinkSecurity& network_;
  const LinkSecurity& local_;
  Socket sock_;
  std::vector<Msg> frames_;
};

}  // namespace bps

#endif  // BPS_TF_CORE_TRANSPORT_SECURITY_H_
