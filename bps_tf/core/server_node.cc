#include "server_node.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "auth.h"
#include "scheduler.h"
#include "stats.h"
#include "sum_engine.h"
#include "transport.h"

namespace bps {

namespace {

// Replies produced by engine threads wait here until the I/O thread sends.
class ReplyQueue {
 public:
  void Post(std::vector<ServerReply>&& replies) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& r : replies) queue_.push_back(std::move(r));
    }
    wake_.Notify();
  }
  std::vector<ServerReply> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<ServerReply> out;
    out.swap(queue_);
    return out;
  }
  Wakeup& wake() { return wake_; }

 private:
  std::mutex mu_;
  std::vector<ServerReply> queue_;
  Wakeup wake_;
};

void WriteReadyFile(const std::string& path, int port) {
  std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) throw Error("cannot write " + tmp);
  std::fprintf(f, "%d\n", port);
  std::fclose(f);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw Error("cannot rename " + tmp);
}

int PortOf(const std::string& endpoint) {
  size_t colon = endpoint.rfind(':');
  return colon == std::string::npos ? 0 : std::atoi(endpoint.c_str() + colon + 1);
}


class ServerNode {
 public:
  explicit ServerNode(const Config& cfg)
      : cfg_(cfg),
        is_server_(cfg.Get("role") == "server"),
        hosts_scheduler_(cfg.Get("role") == "scheduler" || cfg.GetInt("host_scheduler", 0) != 0),
        server_id_(static_cast<int>(cfg.GetInt("server_id", -1))),
        num_workers_(static_cast<int>(cfg.GetInt("num_workers", 1))),
        heartbeat_s_(cfg.GetDouble("heartbeat_s", 1)),
        timeout_s_(cfg.GetDouble("timeout_s", 30)),
        rendezvous_timeout_s_(cfg.GetDouble("rendezvous_timeout_s", 120)),
        ctx_(static_cast<int>(cfg.GetInt("zmq_io_threads", 1))) {}

  int Run(std::string* error);

 private:
  void HandleRouter(std::vector<Msg>& frames);
  void HandleRouterFrames(std::vector<Msg>& frames);
  void HandleControl(std::vector<Msg>& frames);
  void SendOutgoing(std::vector<Outgoing>* out);
  void SendReplies();
  void SendToScheduler(MsgType type, const std::string& payload);
  std::string Who() const {
    return is_server_ ? "server " + std::to_string(server_id_) : std::string("scheduler");
  }

  Config cfg_;
  bool is_server_;
  bool hosts_scheduler_;
  int server_id_;
  int num_workers_;
  double heartbeat_s_;
  double timeout_s_;
  double rendezvous_timeout_s_;
  Context ctx_;
  std::unique_ptr<Socket> router_;
  std::unique_ptr<Socket> control_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<SumEngine> engine_;
  ReplyQueue replies_;
  std::unordered_map<int, std::string> worker_identity_;
  bool welcomed_ = false;
  bool done_ = false;
  int exit_code_ = 0;
  std::string error_;
  Clock::time_point last_ack_ = Clock::now();
};

void ServerNode::SendToScheduler(MsgType type, const std::string& payload) {
  if (!control_) return;
  Role role = is_server_ ? Role::kServer : Role::kScheduler;
  auto frames = MakeFrames(MakeHeader(type, role, server_id_), payload);
  control_->SendFrames(&frames);
}

void ServerNode::SendOutgoing(std::vector<Outgoing>* out) {
  for (auto& o : *out) {
    std::vector<Msg> frames;
    frames.emplace_back(o.identity.data(), o.identity.size());
    for (auto& f : MakeFrames(o.header, o.payload)) frames.push_back(std::move(f));
    if (!router_->SendFrames(&frames)) {
      BPS_LOG(kDebug, "could not reach " << o.identity << ": " << zmq_strerror(zmq_errno()));
    }
  }
  out->clear();
}

void ServerNode::SendReplies() {
  for (auto& r : replies_.Take()) {
    auto it = worker_identity_.find(r.worker);
    if (it == worker_identity_.end()) continue;
    std::vector<Msg> frames;
    frames.emplace_back(it->second.data(), it->second.size());
    for (auto& f : MakeFrames(r.header, std::move(r.payload))) frames.push_back(std::move(f));
    if (router_->SendFrames(&frames)) {
      Stats::Get().bytes_sent += r.header.payload_bytes;
    } else {
      BPS_LOG(kWarning, "reply to worker " << r.worker << " failed: " << zmq_strerror(zmq_errno()));
    }
  }
}

void ServerNode::HandleRouter(std::vector<Msg>& frames) {
  // Nothing a peer sends may stop the server: a frame that fails any check
  // is dropped and counted.
  try {
    HandleRouterFrames(frames);
  } catch (const std::exception& e) {
    Stats::Get().frames_dropped++;
    BPS_LOG(kDebug, "dropped a frame: " << e.what());
  }
}

void ServerNode::HandleRouterFrames(std::vector<Msg>& frames) {
  if (frames.size() != 3) {
    Stats::Get().frames_dropped++;
    return;
  }
  std::string identity = frames[0].str();
  std::string bad = ValidateHeader(frames[1].data(), frames[1].size(), frames[2].size());
  if (!bad.empty()) {
    Stats::Get().frames_dropped++;
    BPS_LOG(kDebug, "dropped a frame from " << identity << ": " << bad);
    return;
  }
  FrameHeader h;
  std::memcpy(&h, frames[1].data(), sizeof(h));
  MsgType type = static_cast<MsgType>(h.type);
  if (type == MsgType::kPush) {
    if (!engine_ || h.sender_role != static_cast<uint16_t>(Role::kWorker) || h.sender < 0 ||
        h.sender >= num_workers_ || !ValidDType(h.dtype)) {
      Stats::Get().frames_dropped++;
      return;
    }
    // A rank is bound to the connection that first spoke for it, so a
    // stray peer cannot push in another worker's name.
    auto it = worker_identity_.find(h.sender);
    if (it == worker_identity_.end()) {
      worker_identity_[h.sender] = identity;
    } else if (it->second != identity) {
      Stats::Get().frames_dropped++;
      return;
    }
    Stats::Get().bytes_received += h.payload_bytes;
    engine_->Submit(PushJob{h.sender, h.key, h.round, static_cast<int>(h.dtype),
                            std::move(frames[2])});
    return;
  }
  if (scheduler_) {
    std::vector<Outgoing> out;
    scheduler_->Handle(identity, h, frames[2].str(), &out);
    SendOutgoing(&out);
    return;
  }
  Stats::Get().frames_dropped++;
}

void ServerNode::HandleControl(std::vector<Msg>& frames) {
  if (frames.size() != 2) return;
  std::string bad = ValidateHeader(frames[0].data(), frames[0].size(), frames[1].size());
  if (!bad.empty()) return;
  FrameHeader h;
  std::memcpy(&h, frames[0].data(), sizeof(h));
  last_ack_ = Clock::now();
  switch (static_cast<MsgType>(h.type)) {
    case MsgType::kWelcome: {
      Config w = Config::Parse(frames[1].str());
      server_id_ = static_cast<int>(w.GetInt("id", server_id_));
      SetLogIdentity(Who());
      welcomed_ = true;
      Stats::Get().node_state = 1;
      if (is_server_) {
        engine_.reset(new SumEngine(server_id_, num_workers_,
                                    static_cast<int>(cfg_.GetInt("engine_threads", 4)),
                                    cfg_.GetInt("async", 0) != 0,
                                    [this](std::vector<ServerReply>&& r) { replies_.Post(std::move(r)); }));
      }
      SendToScheduler(MsgType::kBarrier, "");
      break;
    }
    case MsgType::kShutdown:
      Stats::Get().node_state = 2;
      done_ = true;
      break;
    case MsgType::kError:
      if (scheduler_) break;  // our own scheduler decides when we stop
      error_ = frames[1].str();
      exit_code_ = 1;
      done_ = true;
      break;
    default:
      break;
  }
}

int ServerNode::Run(std::string* error) {
  std::string bind_host = cfg_.Get("bind_host", "0.0.0.0");
  int64_t port = cfg_.GetInt("port", 0);
  if (cfg_.Get("role") == "scheduler") port = cfg_.GetInt("scheduler_port", 0);
  router_.reset(new Socket(ctx_, zmqc::kRouter));
  // Bound the size of anything a peer can make us allocate.
  router_->SetMaxMsgSize(std::max<int64_t>(cfg_.GetInt("partition_bytes", 4096000), 1 << 20) + 4096);
  std::string bound = router_->Bind(Endpoint(bind_host, port));
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

  if (is_server_) {
    std::string advertise = cfg_.Get("advertise_host", scheduler_host);
    std::string id = "ctl-server-" + std::to_string(server_id_) + "-" + std::to_string(getpid());
    control_.reset(new Socket(ctx_, zmqc::kDealer, id));
    control_->Connect(Endpoint(scheduler_host, scheduler_port));
    Config hello;
    for (const char* key : kSharedSettings) {
      hello.Set(key, cfg_.Get(key));
    }
    hello.Set("hostname", cfg_.Get("hostname"));
    hello.Set("pid", std::to_string(getpid()));
    hello.Set("data_addr", Endpoint(advertise, actual_port));
    SendToScheduler(MsgType::kHello, hello.Serialize());
  }

  auto started = Clock::now();
  auto last_beat = Clock::now();
  auto last_tick = Clock::now();
  Clock::time_point fatal_since{};
  std::vector<Msg> frames;
  std::vector<Outgoing> out;
  while (!done_) {
    zmq_pollitem_t items[3] = {{router_->get(), 0, zmqc::kPollIn, 0},
                               {nullptr, replies_.wake().fd(), zmqc::kPollIn, 0},
                               {control_ ? control_->get() : nullptr, 0, zmqc::kPollIn, 0}};
    int n = control_ ? 3 : 2;
    if (zmq_poll(items, n, 100) < 0) {
      if (zmq_errno() == EINTR) continue;
      break;
    }
    if (items[1].revents) {
      replies_.wake().Drain();
      SendReplies();
    }
    while (router_->RecvFrames(&frames)) HandleRouter(frames);
    while (control_ && control_->RecvFrames(&frames)) HandleControl(frames);
    SendReplies();

    if (scheduler_ && SecondsSince(last_tick) >= 0.2) {
      last_tick = Clock::now();
      scheduler_->Tick(&out);
      SendOutgoing(&out);
      if (scheduler_->finished() && !is_server_) done_ = true;
      if (!is_server_ && scheduler_->welcomed() && Stats::Get().node_state == 0) {
        Stats::Get().node_state = 1;  // a scheduler-only node: the cluster met
      }
      if (!scheduler_->fatal().empty()) {
        Stats::Get().node_state = 3;
        // Stay a little to tell late joiners why the job failed.
        if (fatal_since == Clock::time_point{}) fatal_since = Clock::now();
        if (SecondsSince(fatal_since) > 3) {
          error_ = scheduler_->fatal();
          exit_code_ = 1;
          done_ = true;
        }
      }
    }
    if (control_ && SecondsSince(last_beat) >= heartbeat_s_) {
      last_beat = Clock::now();
      SendToScheduler(MsgType::kHeartbeat, "");
    }
    if (control_ && welcomed_ && SecondsSince(last_ack_) > timeout_s_) {
      error_ = Who() + " lost contact with the scheduler at " + scheduler_host + ":" +
               std::to_string(scheduler_port) + " for " + std::to_string(static_cast<int>(timeout_s_)) +
               " s (BYTEPS_TIMEOUT)";
      exit_code_ = 1;
      done_ = true;
    }
    if (!welcomed_ && !hosts_scheduler_ && SecondsSince(started) > rendezvous_timeout_s_) {
      error_ = Who() + " could not meet the cluster at the scheduler " + scheduler_host + ":" +
               std::to_string(scheduler_port) + " within " +
               std::to_string(static_cast<int>(rendezvous_timeout_s_)) +
               " s (BYTEPS_RENDEZVOUS_TIMEOUT; check DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT)";
      exit_code_ = 1;
      done_ = true;
    }
  }
  Stats::Get().node_state = exit_code_ != 0 ? 3 : 2;
  // Flush the last replies (e.g. the shutdown notices) before closing.
  SendReplies();
  uint64_t dropped = Stats::Get().frames_dropped;
  if (dropped) {
    BPS_LOG(kWarning, "dropped " << dropped << " malformed or unauthenticated frames");
  }
  engine_.reset();
  if (scheduler_ && is_server_ && exit_code_ == 0) {
    // The scheduler host lingers until its Shutdown notices are out.
    router_->SetLinger(2000);
  }
  if (control_) control_->Close();
  router_->Close();
  *error = error_;
  return exit_code_;
}

}  // namespace

int RunServerNode(const Config& cfg, std::string* error) {
  SetLogLevel(cfg.Get("log_level", "WARNING"));
  SetJobToken(cfg.Get("job_token"));
  try {
    ServerNode node(cfg);
    return node.Run(error);
  } catch (const Error& e) {
    *error = e.what();
    return 1;
  }
}

}  // namespace bps
