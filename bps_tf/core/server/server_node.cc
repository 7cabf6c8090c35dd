// A server node's data path: listening and saying HELLO, the pushes and
// their summed replies (fused when small), the main loop and the close.
// Its link to the scheduler is in server_control.cc.
#include "server/server_node.h"

#include <csignal>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <deque>
#include <map>

#include "common/limits.h"
#include "common/stats.h"
#include "server/server_node_impl.h"
#include "transport/cipher_pool.h"
#include "transport/fusion.h"
#include "transport/local_links.h"

namespace bps {

using namespace server_parts;  // NOLINT: this node's own parts

namespace {

// SIGTERMs received (elastic servers only, see ServerNode::Run). The first
// asks to leave at the workers' next commit; the handler then restores the
// default, so a second one ends the process at once (bpslaunch stopping a
// whole job sends two).
std::atomic<int> g_terms{0};
extern "C" void OnTerm(int) {
  g_terms.fetch_add(1);
  signal(SIGTERM, SIG_DFL);
}

}  // namespace

ServerNode::ServerNode(const Config& cfg)
    : cfg_(cfg),
      is_server_(cfg.Get("role") == "server"),
      hosts_scheduler_(cfg.Get("role") == "scheduler" || cfg.GetInt("host_scheduler", 0) != 0),
      num_workers_(static_cast<int>(cfg.GetInt("num_workers", 1))),
      // The workers' cap (worker_engine.cc), so both directions agree.
      fusion_bytes_(static_cast<uint64_t>(std::min<int64_t>(
          std::max<int64_t>(0, cfg.GetInt("fusion_threshold", 0)),
          std::max<int64_t>(cfg.GetInt("partition_bytes", kDefaultPartitionBytes), 1 << 20)))),
      timeout_s_(cfg.GetDouble("timeout_s", 30)),
      rendezvous_timeout_s_(cfg.GetDouble("rendezvous_timeout_s", 120)),
      elastic_(cfg.GetInt("elastic", 0) != 0),
      recovery_s_(cfg.GetDouble("scheduler_recovery_s", 120)),
      // Elastic: ranks up to the largest worker count the job may reach.
      schedule_(std::max<int>(num_workers_, static_cast<int>(cfg.GetInt("elastic", 0) != 0
                                                                 ? cfg.GetInt("elastic_max_workers", 0)
                                                                 : 0)),
                ReplyCredit(cfg), [this] { replies_.wake().Notify(); }),
      channel_(MakeZmqChannel(static_cast<int>(cfg.GetInt("zmq_io_threads", 1)),
                              &replies_.wake(), LinkSecurity::FromConfig(cfg),
                              static_cast<int>(cfg.GetInt("tcp_notsent_lowat", 0)))),
      membership_(channel_.get(), is_server_ ? Role::kServer : Role::kScheduler,
                  static_cast<int>(cfg.GetInt("server_id", -1)),
                  cfg.GetDouble("heartbeat_s", 1)) {
  SetCipherThreads(static_cast<int>(cfg.GetInt("cipher_threads", 0)));
}

void ServerNode::Stop(const std::string& error) {
  error_ = error;
  exit_code_ = error.empty() ? 0 : 1;
  done_ = true;
}

void ServerNode::SendOutgoing(std::vector<Outgoing>* out) {
  for (auto& o : *out) {
    if (!channel_->Send(o.to, o.header, o.payload)) {
      BPS_LOG(kDebug, "could not reach " << o.to.route << ": " << zmq_strerror(zmq_errno()));
    }
  }
  out->clear();
}

void ServerNode::SendReply(int worker, const FrameHeader& header, Msg&& payload,
                           uint64_t reserved, SharedSealSlot* shared) {
  // Tracked even when it cannot be sent: dropping it gives the credit back.
  Msg tracked = schedule_.Track(worker, std::move(payload), reserved);
  auto it = worker_peer_.find(worker);
  if (it == worker_peer_.end()) return;
  const size_t bytes = tracked.size();  // the Msg is handed to libzmq below
  if (channel_->SendShared(it->second, header, std::move(tracked), shared)) {
    Stats::Get().bytes_sent += bytes;
  } else {
    BPS_LOG(kWarning, "reply to worker " << worker << " failed: " << zmq_strerror(zmq_errno()));
  }
}

void ServerNode::SendReplies(bool ignore_credit) {
  schedule_.Add(replies_.Take());
  std::vector<ServerReply> replies = schedule_.Ready(ignore_credit);
  if (fusion_bytes_ == 0) {
    for (auto& r : replies) {
      const uint64_t n = r.payload.size();
      SendReply(r.worker, r.header, std::move(r.payload), n, r.shared.get());
    }
    return;
  }
  // Small sums for one worker that are ready together go back in one
  // message, in the order the engine produced them.
  std::map<int, FusedBuilder> fused;
  auto flush = [this](int worker, FusedBuilder* b, std::deque<ServerReply>* held) {
    if (b->count() == 1) {
      const uint64_t n = held->front().payload.size();
      SendReply(worker, held->front().header, std::move(held->front().payload), n,
                held->front().shared.get());
    } else if (b->count() > 1) {
      uint64_t size = 0, reserved = 0;
      char* data = b->Finish(&size);
      FrameHeader h = MakeHeader(MsgType::kPullReplyFused, Role::kServer, membership_.id());
      for (const ServerReply& r : *held) {
        h.members |= r.header.members;  // see MaybeComplete
        reserved += r.payload.size();
      }
      h.contributors = static_cast<uint32_t>(__builtin_popcountll(h.members));
      SendReply(worker, h, Msg(data, size, &FreeBuffer, nullptr), reserved);
      Stats::Get().fused_messages_sent++;
    }
    held->clear();
    *b = FusedBuilder();
  };
  // What each builder points into; a deque never moves what it holds (a
  // small Msg keeps its bytes inside itself).
  std::map<int, std::deque<ServerReply>> held;
  for (auto& r : replies) {
    uint64_t n = r.payload.size();
    bool small = r.header.type == static_cast<uint16_t>(MsgType::kPullReply) &&
                 kFusedPrefixBytes + 2 * FusedCost(n) <= fusion_bytes_;
    if (!small) {
      SendReply(r.worker, r.header, std::move(r.payload), n, r.shared.get());
      continue;
    }
    FusedBuilder& b = fused[r.worker];
    std::deque<ServerReply>& h = held[r.worker];
    if (b.count() && b.bytes() + FusedCost(n) > fusion_bytes_) flush(r.worker, &b, &h);
    FusedPart fp;
    std::memset(&fp, 0, sizeof(fp));
    fp.key = r.header.key;
    fp.round = r.header.round;
    fp.request_id = r.header.request_id;
    fp.payload_bytes = n;
    fp.dtype = r.header.dtype;
    fp.contributors = r.header.contributors;
    fp.reduce_op = r.header.reduce_op;
    fp.members = r.header.members;
    h.push_back(std::move(r));
    b.Add(fp, h.back().payload.data());
  }
  for (auto& kv : fused) flush(kv.first, &kv.second, &held[kv.first]);
}

void ServerNode::Handle(Message& m) {
  if (membership_.FromScheduler(m)) return HandleControl(m);
  // Nothing a peer sends may stop the server: a message that fails any
  // check is dropped and counted.
  try {
    if (static_cast<MsgType>(m.header.type) == MsgType::kPush ||
        static_cast<MsgType>(m.header.type) == MsgType::kPushCompressed ||
        static_cast<MsgType>(m.header.type) == MsgType::kJoin ||
        static_cast<MsgType>(m.header.type) == MsgType::kPushFused) {
      return HandlePush(m);
    }
    if (scheduler_) {
      std::vector<Outgoing> out;
      scheduler_->Handle(m.from, m.header, m.payload.str(), &out);
      SendOutgoing(&out);
      return;
    }
    Stats::Get().frames_dropped++;
  } catch (const std::exception& e) {
    Stats::Get().frames_dropped++;
    BPS_LOG(kDebug, "dropped a frame: " << e.what());
  }
}

void ServerNode::HandlePush(Message& m) {
  const FrameHeader& h = m.header;
  if (!engine_ || h.sender_role != static_cast<uint16_t>(Role::kWorker) || h.sender < 0 ||
      h.sender >= num_workers_ || !ValidDType(h.dtype)) {
    Stats::Get().frames_dropped++;
    return;
  }
  if (h.epoch != epoch_) {  // a worker of an epoch that ended: its round was dropped
    Stats::Get().frames_stale_epoch++;
    return;
  }
  // A rank is bound to the connection that first spoke for it, so a stray
  // peer cannot push in another worker's name.
  auto it = worker_peer_.find(h.sender);
  if (it == worker_peer_.end()) {
    worker_peer_[h.sender] = m.from;
  } else if (it->second != m.from) {
    Stats::Get().frames_dropped++;
    return;
  }
  if (h.type == static_cast<uint16_t>(MsgType::kJoin)) return engine_->SubmitJoin(h.sender);
  Stats::Get().bytes_received += h.payload_bytes;
  if (h.type == static_cast<uint16_t>(MsgType::kPushFused)) return SubmitFused(m);
  Stats::Get().pushes_received++;
  engine_->Submit(JobOf(h.sender, h.key, h.round, h.dtype, h.request_id, h.contributors,
                        h.members, h.reduce_op, std::move(m.payload),
                        h.type == static_cast<uint16_t>(MsgType::kPushCompressed)));
}

void ServerNode::SubmitFused(Message& m) {
  std::vector<FusedView> parts;
  std::string why = ParseFused(m.payload.data(), m.payload.size(), &parts);
  for (const FusedView& v : parts) {
    if (!why.empty()) break;
    const FusedPart& p = v.part;
    if (!ValidDType(p.dtype)) why = "a fused part of unknown dtype";
    // The checks ValidateHeader makes of a single push's header.
    if (p.reduce_op > kMaxReduceOp) why = "a fused part with an unknown reduce op";
    if (p.members != 0 && static_cast<uint32_t>(__builtin_popcountll(p.members)) != p.contributors) {
      why = "a fused part whose member mask disagrees with its contributors";
    }
  }
  if (!why.empty()) {
    Stats::Get().frames_dropped++;
    BPS_LOG(kDebug, "dropped a fused push of worker " << m.header.sender << ": " << why);
    return;
  }
  Stats::Get().fused_messages_received++;
  // In the sub-headers' order, which is the worker's priority order.
  // Each part becomes exactly the job its single push would.
  for (const FusedView& v : parts) {
    const FusedPart& p = v.part;
    Stats::Get().pushes_received++;
    engine_->Submit(JobOf(m.header.sender, p.key, p.round, p.dtype, p.request_id, p.contributors,
                          p.members, p.reduce_op, Msg(v.data, p.payload_bytes), false));
  }
}

int ServerNode::Run(std::string* error) {
  if (is_server_ && cfg_.GetInt("malloc_keep_buffers", 1)) {
    Stats::Get().heap_keeps_buffers = KeepFreedBuffersInHeap();
  }
  // Elastic: SIGTERM (a pod's eviction or a node drain, bpslaunch
  // removing a server) means "leave at the next commit": the keys move to
  // the other servers and nothing is rolled back. A server that hosts the
  // scheduler ends at once, as before (its loss is a scheduler restart).
  if (elastic_ && is_server_ && !hosts_scheduler_) {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_handler = OnTerm;
    sigaction(SIGTERM, &sa, nullptr);
  }
  std::string scheduler_at;
  Peer listener = Start(&scheduler_at);
  auto started = Clock::now();
  auto last_tick = Clock::now();
  Clock::time_point fatal_since{};
  Message m;
  std::vector<Outgoing> out;
  while (!done_) {
    if (!channel_->Wait(100)) break;
    // A long stream of small pushes still reaches the lanes in batches, and
    // one that never runs dry still lets the replies, heartbeats and checks run.
    const auto batch = Clock::now();
    for (int handled = 1; channel_->Receive(&m); ++handled) {
      Handle(m);
      if (engine_ && handled % 64 == 0) engine_->Flush();
      if (handled % 64 == 0 && SecondsSince(batch) > 0.05) break;
    }
    if (engine_) engine_->Flush();
    SendReplies();
    if (scheduler_ && SecondsSince(last_tick) >= 0.2) {
      last_tick = Clock::now();
      TickScheduler(&out, &fatal_since);
    }
    WatchScheduler(scheduler_at, started);
    if (g_terms.load() > 0 && !leave_asked_) AskToLeave();
  }
  return Finish(listener, error);
}

Peer ServerNode::Start(std::string* scheduler_at) {
  // A server holds a link from every worker, the scheduler one from every node.
  const long workers = std::max<long>(
      num_workers_, cfg_.GetInt("elastic", 0) != 0 ? cfg_.GetInt("elastic_max_workers", 0) : 0);
  EnsureOpenFiles(kBaseOpenFiles + (is_server_ ? workers : 0) +
                      (hosts_scheduler_ ? workers + cfg_.GetInt("num_servers", 1) : 0),
                  Who() + " of " + std::to_string(workers) + " workers");
  std::string bind_host = cfg_.Get("bind_host", "0.0.0.0");
  int64_t port = cfg_.GetInt("port", 0);
  if (cfg_.Get("role") == "scheduler") port = cfg_.GetInt("scheduler_port", 0);
  // Bound the size of anything a peer can make us allocate.
  std::string bound;
  const int64_t max_message_bytes =
      std::max<int64_t>(cfg_.GetInt("partition_bytes", kDefaultPartitionBytes), 1 << 20) + 4096;
  Peer listener = channel_->Listen(Endpoint(bind_host, port), max_message_bytes, &bound);
  int actual_port = PortOf(bound);
  SetLogIdentity(Who());

  std::string scheduler_host = cfg_.Get("scheduler_host", "127.0.0.1");
  int64_t scheduler_port = cfg_.GetInt("scheduler_port", 0);
  if (hosts_scheduler_) {
    scheduler_.reset(new Scheduler(cfg_));
    scheduler_port = actual_port;
    std::string ready = cfg_.Get("ready_file");
    if (!ready.empty()) WriteReadyFile(ready, actual_port);
  }
  BPS_LOG(kInfo, "listening on " << bound);
  *scheduler_at = scheduler_host + ":" + std::to_string(scheduler_port);

  if (is_server_) {
    Config extra;
    extra.Set("data_addr", Endpoint(cfg_.Get("advertise_host", scheduler_host), actual_port));
    // Workers on this machine (same kernel and network namespace) push over
    // a Unix socket (local_links.h): the kernel moves bulk data through it
    // 1.4-1.9x as fast as through loopback TCP. An abstract name vanishes
    // with the process.
    std::string machine = MachineNetnsId();
    // A Unix-socket link is never retried (channel.cc): one the kernel's
    // backlog refuses would be lost, so such a server is reached over TCP.
    if (!machine.empty() && cfg_.GetInt("enable_ipc", 1) != 0 && KernelListenBacklog() < workers) {
      BPS_LOG(kWarning, "net.core.somaxconn (" << KernelListenBacklog() << ") is below the "
                            << workers << " workers: they reach this server over TCP, not its "
                            "Unix socket (raise net.core.somaxconn to use it)");
    } else if (!machine.empty() && cfg_.GetInt("enable_ipc", 1) != 0) {
      try {
        std::string local;
        channel_->Listen(NewServerSocketEndpoint(), max_message_bytes, &local);
        extra.Set("local_addr", local);
        extra.Set("machine", machine);
      } catch (const std::exception& e) {  // std::random_device's too
        BPS_LOG(kWarning, e.what() << "; workers on this machine reach this server over TCP");
      }
    }
    // Elastic: the launcher reports this process under its launch id.
    extra.Set("launch_id", cfg_.Get("launch_id"));
    membership_.Join(Endpoint(scheduler_host, scheduler_port), cfg_, extra);
  }
  return listener;
}

int ServerNode::Finish(const Peer& listener, std::string* error) {
  Stats::Get().node_state = exit_code_ != 0 ? 3 : 2;
  // Flush the last replies (e.g. the shutdown notices) before closing.
  SendReplies(/*ignore_credit=*/true);
  uint64_t dropped = Stats::Get().frames_dropped;
  if (dropped) BPS_LOG(kWarning, "dropped " << dropped << " malformed frames");
  uint64_t rejected = Stats::Get().frames_rejected;
  if (rejected) {
    BPS_LOG(kWarning, "rejected " << rejected
                                  << " sealed messages that failed authentication or came again "
                                     "or out of order (see the first error above)");
  }
  uint64_t refused = Stats::Get().connections_refused;
  if (refused) {
    BPS_LOG(kWarning, "refused " << refused
                                 << " connections that failed the security handshake");
  }
  engine_.reset();
  membership_.Close();
  // The scheduler host lingers until its Shutdown notices are out.
  channel_->Close(listener, scheduler_ && is_server_ && scheduler_->finished() ? 2000 : 0);
  channel_.reset();
  *error = error_;
  return exit_code_;
}

int RunServerNode(const Config& cfg, std::string* error) {
  SetLogLevel(cfg.Get("log_level", "WARNING"));
  try {
    ServerNode node(cfg);
    return node.Run(error);
  } catch (const Error& e) {
    *error = e.what();
    return 1;
  }
}

}  // namespace bps
