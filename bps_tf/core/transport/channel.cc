// Channel over ZeroMQ: a DEALER per link this node opens and a ROUTER to
// listen on, each secured as LinkSecurity says and watched for failed
// handshakes. With BYTEPS_ENCRYPTION=1 every TCP link is sealed: a handshake
// record each way first, then every message sealed (link_cipher.h).
#include "transport/channel.h"

#include <poll.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <vector>

#include "common/common.h"
#include "common/stats.h"
#include "transport/channel_link.h"
#include "transport/local_links.h"
#include "transport/sealed_links.h"
#include "transport/security.h"

namespace bps {

namespace {

using Link = ChannelLink;

// Marks an alert: an ERROR a listening end seals to a peer whose message it
// rejected, read by the peer's channel (never by an engine). Headers the
// protocol sends keep reserved[] zero (ValidateHeader), so none is mistaken.
constexpr uint8_t kAlertMark = 1;

class ZmqChannel : public Channel {
 public:
  ZmqChannel(int io_threads, Wakeup* wake, const LinkSecurity& security, int unsent_cap)
      : ctx_(io_threads),
        wake_(wake),
        security_(security),
        local_security_(security.ForLocalLinks()),
        unsent_cap_(unsent_cap) {
    if (security_.sealed()) sealed_.reset(new SealedLinks(security_.link_key));
  }
  ~ZmqChannel() override {  // sockets before the context
    links_.clear();
    zap_.reset();
  }

  Peer Connect(const std::string& endpoint, const std::string& name) override {
    links_.emplace_back();
    Link& l = links_.back();
    l.socket.reset(new Socket(ctx_, zmqc::kDealer, name));
    // A local link does not authenticate the listening side (PLAIN): once
    // its server is gone, another process of this namespace could take the
    // name and would get the credential from a reconnect. Servers are never
    // restarted, so a lost local link stays lost (the job fails as for any
    // lost server).
    if (IsIpcEndpoint(endpoint)) l.socket->SetReconnectInterval(-1);
    SecurityOf(endpoint).ApplyClient(l.socket->get());
    l.watch.reset(new HandshakeWatch(ctx_, l.socket.get(), /*drops=*/true));
    l.fd = SocketSignalFd(l.socket->get());
    l.watch_fd = SocketSignalFd(l.watch->socket());
    l.endpoint = endpoint;
    l.sealed = SecurityOf(endpoint).sealed();
    l.socket->Connect(endpoint);
    Peer peer{static_cast<int>(links_.size() - 1), ""};
    // The hello goes first; libzmq queues it until the connection is up.
    if (l.sealed) SendRecord(peer, sealed_->Opened(peer.link));
    return peer;
  }

  Peer Listen(const std::string& endpoint, int64_t max_message_bytes,
              std::string* bound) override {
    // libzmq admits every client when no ZAP handler is bound: it must be
    // there before the first peer can reach the port.
    if (security_.mode != LinkSecurity::Mode::kNone && !zap_) {
      zap_.reset(new ZapHandler(ctx_, security_, local_security_));
      zap_fd_ = SocketSignalFd(zap_->socket());
    }
    Link l;
    l.socket.reset(new Socket(ctx_, zmqc::kRouter));
    l.routed = true;
    // Every worker connects to every server at once: past libzmq's default
    // queue (100), TCP waits for a SYN retry and a Unix-socket link is lost.
    l.socket->SetBacklog(KernelListenBacklog());
    l.socket->SetMaxMsgSize(max_message_bytes);
    SecurityOf(endpoint).ApplyServer(l.socket->get());
    l.watch.reset(new HandshakeWatch(ctx_, l.socket.get()));
    l.fd = SocketSignalFd(l.socket->get());
    l.watch_fd = SocketSignalFd(l.watch->socket());
    l.sealed = SecurityOf(endpoint).sealed();
    *bound = l.endpoint = l.socket->Bind(endpoint);  // a failure leaves no link behind
    links_.push_back(std::move(l));
    return Peer{static_cast<int>(links_.size() - 1), ""};
  }

  bool SendShared(const Peer& to, const FrameHeader& header, Msg&& payload,
                  SharedSealSlot* slot) override {
    Socket* s = SendingOn(to.link);
    if (!s) return false;
    FrameHeader h = header;
    h.payload_bytes = payload.size();
    const Link& l = links_[static_cast<size_t>(to.link)];
    std::vector<Msg> frames;
    if (l.routed) frames.emplace_back(to.route.data(), to.route.size());
    if (!l.sealed) {
      frames.emplace_back(&h, sizeof(h));
      frames.push_back(std::move(payload));
      return s->SendFrames(&frames);
    }
    LinkCipher* cipher = l.routed ? sealed_->Cipher(to.link, to.route) : sealed_->Cipher(to.link);
    if (cipher && slot && payload.size() > 0) {
      if (!slot->seal || slot->seal->suite() != cipher->suite()) {
        slot->seal = std::make_shared<SharedSeal>(cipher->suite(), payload);
      }
      cipher->SealShared(h, slot->seal, std::move(payload), &frames);
      return s->SendFrames(&frames);
    }
    if (cipher) {
      cipher->Seal(h, std::move(payload), &frames);
      return s->SendFrames(&frames);
    }
    if (!l.routed) {  // the handshake is under way: sent once it is done
      sealed_->Hold(to.link, h, std::move(payload));
      return true;
    }
    errno = EHOSTUNREACH;  // a peer that never completed a handshake
    return false;
  }

  bool Wait(long timeout_ms) override {
    // One poll(2) over the signal fds, then libzmq is asked only about the
    // sockets that signalled or were sent on. zmq_poll asks every socket
    // before and after it waits, a system call each: with 32 servers, two
    // sockets each, that was most of a worker's CPU at 256 workers.
    bool pending = false;
    for (auto& l : links_) {
      if (!l.socket) continue;
      if (l.sent) l.readable = l.readable || SocketHasInput(l.socket->get());
      l.sent = false;
      pending = pending || l.readable || l.watch_readable;
    }
    fds_.clear();
    fds_.push_back({wake_->fd(), POLLIN, 0});
    if (zap_) fds_.push_back({zap_fd_, POLLIN, 0});
    for (auto& l : links_) {
      if (!l.socket) continue;
      fds_.push_back({l.fd, POLLIN, 0});
      fds_.push_back({l.watch_fd, POLLIN, 0});
    }
    const int n = poll(fds_.data(), fds_.size(), pending ? 0 : static_cast<int>(timeout_ms));
    if (n < 0) return errno == EINTR;
    if (fds_[0].revents) wake_->Drain();
    // Every 100 ms every socket is asked, busy or not (a process that
    // always has traffic never has a quiet wait): a signal this bookkeeping
    // missed costs a moment, never a lost link.
    const bool sweep = SecondsSince(last_sweep_) > 0.1;
    if (sweep) last_sweep_ = Clock::now();
    size_t k = zap_ ? 2 : 1;
    for (auto& l : links_) {
      if (!l.socket) continue;
      const bool signalled = fds_[k++].revents != 0, watch_signalled = fds_[k++].revents != 0;
      if ((signalled || sweep) && !l.readable) {
        l.readable = SocketHasInput(l.socket->get());
        if (l.readable && !signalled) Stats::Get().sweep_found_input++;
      }
      if ((watch_signalled || sweep) && !l.watch_readable) {
        l.watch_readable = SocketHasInput(l.watch->socket());
      }
    }
    CheckHandshakes();
    return true;
  }

  bool Receive(Message* m) override {
    // Links take turns: a data link that never runs dry must not starve the scheduler's.
    for (size_t tried = 0; tried < links_.size(); ++tried) {
      const size_t i = next_;
      next_ = (next_ + 1) % links_.size();
      Socket* s = links_[i].readable ? links_[i].socket.get() : nullptr;
      while (s && s->RecvFrames(&frames_)) {
        if (Unpack(static_cast<int>(i), m)) return true;
      }
      links_[i].readable = false;  // drained: until Wait finds it readable again
    }
    return false;
  }

  void Close(const Peer& link, int linger_ms) override {
    Socket* s = Open(link.link);
    if (!s) return;
    s->SetLinger(linger_ms);
    Link& l = links_[static_cast<size_t>(link.link)];
    l.watch.reset();
    l.socket.reset();
    if (sealed_) sealed_->Close(link.link);
  }

  std::string Refusal() const override { return refusal_; }

  bool Dropped(const Peer& link) const override {
    return link.link >= 0 && static_cast<size_t>(link.link) < links_.size() &&
           links_[static_cast<size_t>(link.link)].dropped;
  }

  void SetPayloadSink(PlainSink sink) override {
    if (!sink) {
      sink_ = nullptr;
      return;
    }
    // Only a header that would pass Unpack's check may name a buffer.
    sink_ = [sink](const FrameHeader& h, size_t bytes) -> char* {
      FrameHeader copy = h;
      return ValidateHeader(&copy, sizeof(copy), bytes).empty() ? sink(h, bytes) : nullptr;
    };
  }

 private:
  const LinkSecurity& SecurityOf(const std::string& endpoint) const {
    return IsIpcEndpoint(endpoint) ? local_security_ : security_;
  }

  Socket* Open(int link) {
    if (link < 0 || static_cast<size_t>(link) >= links_.size()) return nullptr;
    return links_[static_cast<size_t>(link)].socket.get();
  }

  // The socket of `link`, to send on (Wait asks it again, Link::sent).
  Socket* SendingOn(int link) {
    Socket* s = Open(link);
    if (s) links_[static_cast<size_t>(link)].sent = true;
    return s;
  }

  void CheckHandshakes() {
    if (zap_) zap_->Serve();
    for (Link& l : links_) l.TakeWatchEvents(SecurityOf(l.endpoint), unsent_cap_, &refusal_);
  }

  // [route] [header] [payload] on the listening link, [header] [payload]
  // on the others; on sealed links the header is sealed too (link_cipher.h).
  // One-frame messages are the records of the security handshake.
  bool Unpack(int link, Message* m) {
    const Link& l = links_[static_cast<size_t>(link)];
    size_t first = l.routed ? 1 : 0;
    m->from = Peer{link, first ? frames_[0].str() : std::string()};
    m->delivered = false;
    if (frames_.size() == first + 1) {
      OnRecord(link, m->from, frames_[first]);
      return false;
    }
    std::string bad;
    if (frames_.size() != first + 2) {
      bad = "unexpected frame count";
    } else if (l.sealed) {
      if (!OpenSealed(link, m->from, &m->header, &m->delivered)) return false;  // counted there
      bad = ValidateHeader(&m->header, sizeof(m->header), frames_[first + 1].size());
    } else {
      bad = ValidateHeader(frames_[first].data(), frames_[first].size(), frames_[first + 1].size());
      if (bad.empty()) std::memcpy(&m->header, frames_[first].data(), sizeof(m->header));
    }
    if (!bad.empty()) {
      Stats::Get().frames_dropped++;
      if (l.sealed || !ForeignRelease(link, m->from, frames_[first])) {
        BPS_LOG(kDebug, "dropped a frame" << (first ? " from " + m->from.route : "") << ": " << bad);
      }
      return false;
    }
    m->payload = std::move(frames_[first + 1]);
    return true;
  }

  // A one-frame message: a peer's hello or answer, or a refusal in clear.
  void OnRecord(int link, const Peer& from, const Msg& record) {
    Link& l = links_[static_cast<size_t>(link)];
    const bool verified = l.sealed && !l.routed && sealed_->Cipher(link);
    if (l.routed && IsHandshakeRecord(record)) return AnswerHello(link, from, record);
    if (!l.routed && !verified && IsRefusalRecord(record)) {
      if (refusal_.empty()) {
        refusal_ = ExplainRefusal(l.endpoint, RefusalText(record), SecurityOf(l.endpoint));
      }
      return;
    }
    if (!l.routed && l.sealed && !verified && IsHandshakeRecord(record)) {
      std::string why;
      if (!sealed_->Finish(link, record, &why)) {
        if (refusal_.empty()) {
          refusal_ = "the connection to " + l.endpoint + " was refused: its answer to this " +
                     "node's handshake does not verify (" + why + ")";
        }
        return;
      }
      for (auto& held : sealed_->TakeHeld(link)) Send(from, held.first, std::move(held.second));
      return;
    }
    Stats::Get().frames_dropped++;
    BPS_LOG(kDebug, "dropped a one-frame message on " << l.endpoint);
  }

  // A peer's hello on the listening link: answered when it is the job's.
  void AnswerHello(int link, const Peer& from, const Msg& hello) {
    const Link& l = links_[static_cast<size_t>(link)];
    std::string why;
    Msg answer;
    if (!l.sealed) {
      why = "a peer uses encryption (BYTEPS_ENCRYPTION=1) and this node does not";
      if (FirstWordTo(link, from)) SendRecord(from, RefusalRecord(SecurityOf(l.endpoint).Describe()));
    } else if (sealed_->Answer(link, from.route, hello, &answer, &why)) {
      SendRecord(from, std::move(answer));
      return;
    } else {
      // Told, so that it stops at once rather than at its rendezvous
      // timeout (the gate before the handshake admits any node: security.cc).
      if (FirstWordTo(link, from)) {
        SendRecord(from, RefusalRecord(SecurityOf(l.endpoint).Describe() +
                                       ", and refused this node's handshake: " + why));
      }
      why = "a peer's handshake failed: " + why;
    }
    RefusedPeer(l, why);
  }

  // Opens a sealed message into frames_; false when it is not one to hand
  // to the engine (an alert, or rejected: counted and answered here).
  bool OpenSealed(int link, const Peer& from, FrameHeader* h, bool* delivered) {
    const Link& l = links_[static_cast<size_t>(link)];
    const size_t first = l.routed ? 1 : 0;
    bool known = false;
    LinkCipher::Verdict v = sealed_->Open(link, from.route, frames_[first], &frames_[first + 1], h,
                                          &known, &sink_, delivered);
    if (v == LinkCipher::Verdict::kOk) {
      if (h->type != static_cast<uint16_t>(MsgType::kError) || h->reserved[0] != kAlertMark) {
        return true;
      }
      if (!l.routed && refusal_.empty()) refusal_ = Printable(frames_[first + 1].str());
      return false;
    }
    if (!known) {
      Uninvited(link, from, frames_[first]);
      return false;
    }
    // A peer with a verified handshake: the message was changed, forged,
    // replayed or reordered on the way. Accepting a later one would lose
    // or repeat it, so the link ends here, and with it the job.
    const uint64_t rejected = ++Stats::Get().frames_rejected;
    const bool replayed = v == LinkCipher::Verdict::kReplayed;
    if (!l.routed) {
      if (refusal_.empty()) refusal_ = ExplainRejected(l.endpoint, replayed);
      return false;
    }
    // The first says why; the count comes at exit (a peer of the job that
    // keeps trying must not flood the log).
    if (rejected == 1) {
      BPS_LOG(kError, "rejected a message from a peer (" << Printable(from.route) << ") on "
                          << l.endpoint << ": it " << RejectionCause(replayed)
                          << "; the peer is told and its link closed");
    }
    LinkCipher* cipher = sealed_->Answered(link, from.route);
    if (cipher) {
      FrameHeader alert = MakeHeader(MsgType::kError, Role::kScheduler, -1);
      alert.reserved[0] = kAlertMark;
      const std::string text = ExplainRejectedFromPeer(l.endpoint, replayed);
      alert.payload_bytes = text.size();
      std::vector<Msg> frames;
      frames.emplace_back(from.route.data(), from.route.size());
      cipher->Seal(alert, Msg(text.data(), text.size()), &frames);
      SendingOn(link)->SendFrames(&frames);
    }
    sealed_->Forget(link, from.route);
    return false;
  }

  // A two-frame message on a sealed link from a peer without a verified
  // handshake: dropped; one in clear of this release comes from a node
  // with encryption off, which is told why nothing it says is read.
  void Uninvited(int link, const Peer& from, const Msg& head) {
    Stats::Get().frames_dropped++;
    const Link& l = links_[static_cast<size_t>(link)];
    uint32_t magic = 0;
    if (head.size() == sizeof(FrameHeader)) std::memcpy(&magic, head.data(), sizeof(magic));
    if (!l.routed || magic != kMagic || ForeignRelease(link, from, head)) {
      BPS_LOG(kDebug, "dropped a message from a peer without a handshake on " << l.endpoint);
      return;
    }
    RefusedPeer(l, "a peer does not encrypt (BYTEPS_ENCRYPTION=0) and this node does");
    if (FirstWordTo(link, from)) SendRecord(from, RefusalRecord(SecurityOf(l.endpoint).Describe()));
  }

  void RefusedPeer(const Link& l, const std::string& why) {
    // An intruder retrying must not flood the log: the first says why.
    if (++Stats::Get().connections_refused == 1) {
      BPS_LOG(kWarning, "refused a connection on " << l.endpoint << ": " << why);
    }
  }

  // Whether `to` has not been told why it is refused yet (bounded).
  bool FirstWordTo(int link, const Peer& to) {
    return told_.size() < kMaxForeignPeersRemembered &&
           told_.insert(std::to_string(link) + "/" + to.route).second;
  }

  // One frame (a record) to a peer, never sealed.
  void SendRecord(const Peer& to, Msg&& record) {
    Socket* s = SendingOn(to.link);
    if (!s) return;
    std::vector<Msg> frames;
    if (links_[static_cast<size_t>(to.link)].routed) frames.emplace_back(to.route.data(), to.route.size());
    frames.push_back(std::move(record));
    s->SendFrames(&frames);
  }

  // A frame with our magic number but another protocol version comes from a
  // process of another bps_tf release: mixing releases in one job is a setup
  // error, and without this its nodes would only time out at rendezvous with
  // "dropped malformed frames". The first such frame of each peer is logged
  // as an error, and a peer on the listening link (every node says HELLO to
  // the scheduler first) gets an ERROR frame stamped with *its* version, so
  // it fails at once with the reason, whichever release it runs: the magic
  // number, version field and 64-byte header are the part of the protocol
  // every release keeps.
  bool ForeignRelease(int link, const Peer& from, const Msg& header) {
    uint32_t magic = 0;
    uint16_t version = 0;
    if (header.size() < sizeof(magic) + sizeof(version)) return false;
    std::memcpy(&magic, header.data(), sizeof(magic));
    std::memcpy(&version, header.data() + sizeof(magic), sizeof(version));
    if (magic != kMagic || version == kProtocolVersion) return false;
    Stats::Get().frames_foreign_release++;
    if (foreign_peers_.size() >= kMaxForeignPeersRemembered ||
        !foreign_peers_.insert(std::to_string(link) + "/" + from.route).second) {
      return true;
    }
    std::string who = from.route.empty() ? links_[static_cast<size_t>(link)].endpoint
                                         : "a peer (" + Printable(from.route) + ")";
    std::string why = "mixed bps_tf releases in one job: " + who + " speaks wire protocol version " +
                      std::to_string(version) + ", this node speaks version " +
                      std::to_string(kProtocolVersion) +
                      ". Every worker, server and scheduler of a job must run the same bps_tf "
                      "release (compare `python -c 'import bps_tf; print(bps_tf.__version__)'` "
                      "on each host).";
    BPS_LOG(kError, why);
    if (links_[static_cast<size_t>(link)].routed && header.size() == sizeof(FrameHeader)) {
      FrameHeader h = MakeHeader(MsgType::kError, Role::kScheduler, -1);
      h.version = version;
      h.payload_bytes = why.size();
      // In clear: a node of another release reads no sealed message.
      Socket* s = SendingOn(link);
      std::vector<Msg> frames;
      frames.emplace_back(from.route.data(), from.route.size());
      frames.emplace_back(&h, sizeof(h));
      frames.emplace_back(why.data(), why.size());
      if (s) s->SendFrames(&frames);
    }
    return true;
  }

  static std::string Printable(const std::string& route) {
    std::string out;
    for (char c : route) out += (c >= 32 && c < 127) ? c : '?';
    return out;
  }

  // Bounds the memory a stream of forged versions can take.
  static constexpr size_t kMaxForeignPeersRemembered = 256;

  Context ctx_;
  Wakeup* wake_;
  LinkSecurity security_;
  LinkSecurity local_security_;  // ipc:// links
  int unsent_cap_;  // TCP_NOTSENT_LOWAT of every connection (0: the kernel's)
  PlainSink sink_;  // SetPayloadSink's, behind the header check
  std::unique_ptr<ZapHandler> zap_;  // answers for the listening link
  std::unique_ptr<SealedLinks> sealed_;  // with BYTEPS_ENCRYPTION=1
  std::vector<Link> links_;
  int zap_fd_ = -1;  // zap_'s signal fd
  std::vector<pollfd> fds_;  // what Wait polls
  Clock::time_point last_sweep_;
  std::vector<Msg> frames_;
  std::string refusal_;
  std::set<std::string> foreign_peers_;  // link/route of peers already told
  std::set<std::string> told_;           // link/route of peers refused a record
  size_t next_ = 0;  // the link Receive reads next
};

}  // namespace

std::unique_ptr<Channel> MakeZmqChannel(int io_threads, Wakeup* wake,
                                        const LinkSecurity& security, int unsent_cap) {
  return std::unique_ptr<Channel>(new ZmqChannel(io_threads, wake, security, unsent_cap));
}

}  // namespace bps
