// The engines' view of the network (the role ps-lite calls the "Van"): whole
// messages to and from peers, and one wait for all of them. Sockets, frames,
// routing identities, the checking of headers and the security of every
// connection (security.h) stay behind it, so an engine only decides what to
// say and to whom.
//
// A channel belongs to one thread. Other threads reach that thread through
// the Wakeup it was made with, which outlives it: libzmq may release a
// zero-copy buffer, and its owner notify, while the channel is closing.
#ifndef BPS_TF_CORE_TRANSPORT_CHANNEL_H_
#define BPS_TF_CORE_TRANSPORT_CHANNEL_H_

#include <cstdint>
#include <memory>
#include <string>

#include "transport/link_cipher.h"
#include "transport/protocol.h"
#include "transport/security.h"
#include "transport/transport.h"

namespace bps {

// Where a message came from, and where a reply goes. `link` is a connection
// this node opened or the one it listens on; on the listening link, `route`
// tells the peers apart. Engines keep peers but never look inside.
struct Peer {
  int link = -1;
  std::string route;

  bool valid() const { return link >= 0; }
  bool operator==(const Peer& o) const { return link == o.link && route == o.route; }
  bool operator!=(const Peer& o) const { return !(*this == o); }
  bool operator<(const Peer& o) const {
    return link != o.link ? link < o.link : route < o.route;
  }
};

struct Message {
  Peer from;
  FrameHeader header;
  Msg payload;
  // True when the payload was decrypted straight into the buffer the
  // channel's payload sink named; `payload` then holds only ciphertext.
  bool delivered = false;
};

class Channel {
 public:
  virtual ~Channel() = default;

  // Opens a link to a listening node; `name` tells it who this end is. An
  // ipc:// endpoint (a Unix socket on this machine) gets the security of
  // local links (security.h), any other the job's.
  virtual Peer Connect(const std::string& endpoint, const std::string& name) = 0;
  // Starts listening; *bound is the endpoint bound (port 0 picks one). No
  // peer can make this node allocate a message over max_message_bytes.
  virtual Peer Listen(const std::string& endpoint, int64_t max_message_bytes,
                      std::string* bound) = 0;
  // Sends the header, its payload size filled in, and the payload. False
  // (errno in zmq_errno()) when the peer is unknown or its link is closed.
  bool Send(const Peer& to, const FrameHeader& header, Msg&& payload) {
    return SendShared(to, header, std::move(payload), nullptr);
  }
  bool Send(const Peer& to, const FrameHeader& header, const std::string& payload) {
    return Send(to, header, Msg(payload.data(), payload.size()));
  }
  // Send, for a payload that goes unchanged to several peers (a server's
  // sum, to each worker): every send of it passes the same slot, and sealed
  // links encrypt it once for all of them (link_cipher.h SharedSeal). The
  // caller keeps the bytes unchanged while the slot lives. A null slot: a
  // payload for this peer alone (Send).
  virtual bool SendShared(const Peer& to, const FrameHeader& header, Msg&& payload,
                          SharedSealSlot* slot) = 0;
  // Blocks up to timeout_ms for traffic or a notice on the channel's
  // Wakeup; false if waiting failed.
  virtual bool Wait(long timeout_ms) = 0;
  // Takes the next message without blocking; false when none is left.
  // Malformed messages never come out: they are counted in
  // Stats::frames_dropped. Peers that fail the security handshake never
  // get this far: they are counted in Stats::connections_refused.
  virtual bool Receive(Message* m) = 0;
  // Why a link this node opened was refused at its handshake (wrong token,
  // security settings that differ, ...), for the user; empty while none was.
  // A refused link never carries a message, so the caller should give up.
  virtual std::string Refusal() const = 0;
  // Whether the connection of a link this node opened broke since it was
  // made (the peer's process ended, or the network dropped it). libzmq
  // reconnects on its own, but a sealed link's keys were the old peer's: a
  // node that must reach a restarted peer opens a new link (elastic jobs
  // re-register with a restarted scheduler this way).
  virtual bool Dropped(const Peer& link) const = 0;
  // Sealed links decrypt a message's payload to the buffer `sink` names for
  // its header (checked like every header first), sparing the engine the
  // copy; the message then comes out with `delivered` set. Called on the
  // channel's thread. Links in clear ignore it.
  virtual void SetPayloadSink(PlainSink sink) = 0;
  // Closes a link; what it still queues is kept for up to linger_ms, then
  // dropped, which also hands zero-copy buffers back to their owners.
  virtual void Close(const Peer& link, int linger_ms = 0) = 0;
};

// unsent_cap: TCP_NOTSENT_LOWAT for every TCP connection of the channel,
// bytes (0 leaves the kernel's default).
std::unique_ptr<Channel> MakeZmqChannel(int io_threads, Wakeup* wake,
                                        const LinkSecurity& security, int unsent_cap = 0);

// Checks Wait against lost signals: two channels in this thread ping-pong
// `rounds` times over loopback TCP, and the side that got an answer sends
// once more before it waits for it (a send takes in libzmq's signal of the
// answer). Returns how many waits took over half of `timeout_ms` for a
// message that was there (0 when none was lost; it stops at 3).
long ChannelSlowWaits(long rounds, long timeout_ms);

}  // namespace bps

#endif  // BPS_TF_CORE_TRANSPORT_CHANNEL_H_
