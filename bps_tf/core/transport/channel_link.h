// One link of the ZeroMQ channel (channel.cc): its socket, the watch on its
// connections and handshakes, and what the channel knows of it.
#ifndef BPS_TF_CORE_TRANSPORT_CHANNEL_LINK_H_
#define BPS_TF_CORE_TRANSPORT_CHANNEL_LINK_H_

#include <memory>
#include <string>

#include "transport/security.h"
#include "transport/transport.h"

namespace bps {

struct ChannelLink {
  std::unique_ptr<Socket> socket;         // null once closed
  std::unique_ptr<HandshakeWatch> watch;  // declared after: destroyed first
  bool routed = false;                    // the listening link
  bool sealed = false;                    // its messages go through SealedLinks
  std::string endpoint;
  int failures_in_a_row = 0;
  bool connected = false;  // a connection was made (kEventConnected)
  // May hold a message: set by Wait, cleared once drained. Only those are
  // read, so a node with hundreds of links does not try each one at every
  // wake-up.
  bool readable = true, watch_readable = true;
  bool dropped = false;  // its connection broke since it was up (Dropped)
  // Signal fds of the socket and of its watch (Wait polls them).
  int fd = -1, watch_fd = -1;
  // Sent on since the last Wait: a send takes in the socket's commands, and
  // with them the signal of a message that came in meanwhile, so the socket
  // is asked once more instead of trusting its fd.
  bool sent = false;

  // Takes what the watch reported since the last call (when watch_readable):
  // a connection made or dropped, a handshake that failed. Caps the unsent
  // bytes of a new TCP connection at `unsent_cap`; a link that cannot work
  // sets *refusal (the first reason only) for the user.
  void TakeWatchEvents(const LinkSecurity& security, int unsent_cap, std::string* refusal);
};

}  // namespace bps

#endif  // BPS_TF_CORE_TRANSPORT_CHANNEL_LINK_H_
