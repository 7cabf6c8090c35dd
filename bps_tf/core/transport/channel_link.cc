#include "transport/channel_link.h"

#include "common/common.h"
#include "common/stats.h"
#include "transport/local_links.h"

namespace bps {

namespace {
// A closed connection in the middle of a handshake has an innocent cause
// now and then (the peer was restarting); the same failure again and again
// means the two ends cannot agree.
constexpr int kFailuresBeforeRefusal = 3;
}  // namespace

void ChannelLink::TakeWatchEvents(const LinkSecurity& security, int unsent_cap,
                                  std::string* refusal) {
  HandshakeEvent e;
  while (watch && watch_readable && watch->Next(&e)) {
    if (e.dropped()) {
      if (!routed) dropped = true;
    } else if (e.connection()) {
      connected = true;
      if (!IsIpcEndpoint(endpoint)) CapUnsentBytes(static_cast<int>(e.value), unsent_cap);
    } else if (e.closed()) {
      // A TCP attempt is retried; a Unix-socket link that never connected
      // is not (Connect), and what it queues would wait forever.
      if (!routed && !connected && IsIpcEndpoint(endpoint) && refusal->empty()) {
        *refusal = UnixLinkGaveUp(endpoint);
      }
    } else if (!e.failed()) {
      failures_in_a_row = 0;
    } else if (routed) {
      uint64_t n = ++Stats::Get().connections_refused;
      // An intruder retrying must not flood the log: the first refusal
      // says why, the count comes at exit.
      if (n == 1) {
        BPS_LOG(kWarning, "refused a connection on " << endpoint << ": "
                              << ExplainHandshakeFailure(e, security, false));
      }
    } else if (++failures_in_a_row >= kFailuresBeforeRefusal || e.definitive()) {
      if (refusal->empty()) {
        *refusal = "the connection to " + endpoint + " was refused: " +
                   ExplainHandshakeFailure(e, security, true);
      }
    }
  }
  watch_readable = false;  // drained: until its fd signals again
}

}  // namespace bps
