// The scheduler: where nodes meet. It checks that every node agrees on the
// cluster settings, hands out the layout, runs barriers, matches tensor
// declarations across workers (catching shape/dtype mismatches before any
// data moves; a process set's declarations wait for its members only), assigns partitions to servers balanced by bytes, and watches
// heartbeats so a dead peer stops the whole job instead of hanging it.
//
// It is pure logic: the node that hosts it feeds it messages and sends what
// it returns, so it is easy to test and to place (server 0 or alone).
// scheduler.cc holds the meeting (hello, barrier, heartbeats, goodbyes),
// scheduler_welcome.cc the first WELCOME and the wait for it,
// scheduler_declare.cc the tensor declarations, join and the stall check,
// scheduler_elastic.cc the membership epochs of elastic training
// (docs/elastic.md): a lost worker starts a new epoch instead of failing
// the job, and workers that wait to join are admitted at the next one;
// scheduler_servers.cc does the same for servers (lost, leaving, joining),
// and scheduler_recover.cc rebuilds a restarted scheduler's membership
// from what the nodes report.
#ifndef BPS_TF_CORE_SCHEDULER_SCHEDULER_H_
#define BPS_TF_CORE_SCHEDULER_SCHEDULER_H_

#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/common.h"
#include "transport/channel.h"
#include "transport/protocol.h"

namespace bps {

struct Outgoing {
  Peer to;
  FrameHeader header;
  std::string payload;
};

// Who joined last, from the JOIN_NOTICEs in arrival order, each with the
// workers whose joins that worker's results had counted (bit r).
int LastToJoin(const std::vector<std::pair<int, uint64_t>>& order);

class Scheduler {
 public:
  explicit Scheduler(const Config& cfg);

  void Handle(const Peer& from, const FrameHeader& header,
              const std::string& payload, std::vector<Outgoing>* out);
  // Periodic checks (heartbeats, lingering after a fatal error).
  void Tick(std::vector<Outgoing>* out);

  bool finished() const { return finished_; }
  // Why a finished job failed: the workers that left with a reason (see
  // bps_worker_leave), e.g. "worker 1 (host a, pid 7) was interrupted
  // (SIGINT)"; "" when every worker finished.
  const std::string& failure() const { return failure_; }
  bool welcomed() const { return welcomed_; }
  const std::string& fatal() const { return fatal_; }
  bool elastic() const { return elastic_; }
  int epoch() const { return epoch_; }

 private:
  struct Node {
    Peer peer;
    Role role;
    int id = -1;
    std::string hostname;
    std::string host_key;  // which workers share a machine (and its memory)
    std::string data_addr;
    std::string local_addr;  // a server's ipc:// endpoint for its machine's workers
    std::string machine;     // MachineNetnsId() of a server with local_addr
    std::string pid;
    int local_rank = -1;
    int local_size = -1;
    Clock::time_point last_seen;
    bool departed = false;
    int arrival = 0;  // elastic: newcomers take ranks in the order they arrived
    bool told_left = false;  // has had its kPeerLeft (a worker keeps the first only)
    // Elastic: the launcher's name for the process (BYTEPS_LAUNCH_ID, its
    // "[worker N]"), the rank the launcher planned for a newcomer (newcomers
    // are ranked by it, as Horovod ranks hosts in order; -1: by arrival),
    // and whether it was asked to leave at the next commit.
    std::string launch_id;
    int start_rank = -1;
    bool leaving = false;
  };
  struct Pending {
    int expected;  // declarations that complete it: every worker, or one per host
    std::string sig;
    Peer peer;
    uint64_t request_id;
    std::vector<int> members;  // its process set; empty: every worker
    int dtype;
    int64_t bytes;
  };
  // A name whose declarations named overlapping but different process sets:
  // the members that have not declared it yet get the same error.
  struct SetConflict {
    std::string error;
    std::set<int> expected;
  };
  struct Assignment {
    uint64_t key;
    std::vector<int> servers;  // each partition's server: its place in ServersInOrder()
    int dtype = 0;
    uint64_t bytes = 0;
  };
  // The workers' hosts, as each worker's WELCOME describes them.
  struct HostLayout {
    std::map<std::string, std::vector<Node*>> by_host;  // host key -> its workers, by rank
    std::map<int, std::string> host_ranks;               // rank -> its host's ranks ("0,1")
    std::map<int, int> host_index;                       // rank -> its host's index
    std::map<int, std::vector<int>> hosts_of_local_rank;  // local rank -> host indexes
    bool homogeneous = true;
    std::string job_nonce;
  };

  // An int from a peer's text; a malformed one counts as `dflt`.
  static int KvInt(const Config& kv, const std::string& key, int dflt);

  void OnHello(const Peer& from, const FrameHeader& h, const Config& kv,
               std::vector<Outgoing>* out);
  void OnDeclare(const Peer& from, const FrameHeader& h, const Config& kv,
                 std::vector<Outgoing>* out);
  // Once every node joined: the first WELCOME (scheduler_welcome.cc).
  void MaybeWelcome(std::vector<Outgoing>* out);
  // MaybeWelcome's steps: gives servers without an id the free ones and
  // lists the servers by id (false: the job failed); groups the workers by
  // host (their local ranks, host roots, cross ranks); one node's WELCOME.
  bool NumberServers(std::vector<const Node*>* servers_by_id, std::vector<Outgoing>* out);
  HostLayout LayOutHosts();
  Config WelcomeOf(const Node& n, const HostLayout& hosts,
                   const std::vector<const Node*>& servers_by_id) const;
  // OnDeclare's steps: an asynchronous key is answered at once; a declared
  // process set must be a rising list of ranks with `rank` in it (or empty);
  // a declaration naming a set that overlaps another set declared under the
  // same name fails, with every member of either (true when it did).
  void DeclareAsync(const Peer& from, const FrameHeader& h, const std::string& name,
                    const std::string& sig, int rank, int64_t bytes, std::vector<Outgoing>* out);
  bool ParseMembers(const std::string& list, int rank, std::vector<int>* members) const;
  bool RefuseOtherSet(const std::string& name, int rank, const Peer& from, uint64_t request_id,
                      const std::vector<int>& members, std::vector<Outgoing>* out);
  void ReplyError(const Peer& to, uint64_t request_id, const std::string& why,
                  std::vector<Outgoing>* out);
  // A worker joined: declarations stop waiting for it; when every worker
  // has, each is told which joined last.
  // `seen`: the workers whose joins `rank`'s results had counted (bit r).
  void OnJoin(int rank, uint64_t seen, std::vector<Outgoing>* out);
  // Answers the declarations of `name` with process set `members` (empty:
  // every worker) once each member has made it or has joined.
  void MaybeDeclare(const std::string& name, const std::vector<int>& members,
                    std::vector<Outgoing>* out);
  void Fail(const std::string& message, std::vector<Outgoing>* out);
  // A worker's goodbye: tells the others, and ends the job with the last one.
  void OnBye(Node* node, const std::string& reason, std::vector<Outgoing>* out);
  // OnBye's steps: an elastic worker's goodbye with a reason (it leaves at
  // a commit, restarts its membership or failed) starts a new epoch; the
  // last worker's goodbye sends waiting newcomers away, tells the launcher
  // and shuts the servers down.
  void OnElasticBye(Node* node, const std::string& reason, std::vector<Outgoing>* out);
  void FinishJob(std::vector<Outgoing>* out);
  Outgoing Reply(const Peer& to, MsgType type, const std::string& payload,
                 uint64_t request_id = 0);
  std::string Describe(const Node& n) const;
  void CheckStalls(std::vector<Outgoing>* out);
  // Until every node joined: who is missing, logged every 10 s (a third
  // of a shorter BYTEPS_RENDEZVOUS_TIMEOUT), as the nodes log their waiting.
  void ReportMissing();
  // "worker(s) 1; 1 of 2 servers (2 of 4 nodes joined)".
  std::string Missing() const;
  // Fails the job once the cluster has not met for longer than every node
  // waits (BYTEPS_RENDEZVOUS_TIMEOUT, plus a margin); true if it did.
  bool RendezvousExpired(std::vector<Outgoing>* out);
  // Answers the declarations of `name` by `ranks` (all made with one process set).
  void Complete(const std::string& name, const std::vector<int>& ranks,
                std::vector<Outgoing>* out);
  static std::string Encode(const Assignment& a);
  // Why a node's settings differ from the scheduler's ("" when they agree);
  // an elastic worker's worker count is the scheduler's to set.
  std::string SettingsDisagree(const Node& n, const Config& kv) const;

  // Elastic membership (scheduler_elastic.cc). A worker's HELLO once the
  // job runs (or without a rank): a survivor coming back for the new epoch,
  // or a newcomer that waits for the next one.
  void OnElasticHello(const Peer& from, const Node& n, const Config& kv,
                      std::vector<Outgoing>* out);
  // Starts epoch epoch_+1: every surviving worker (all but `lost`) is
  // forgotten until it says HELLO again. `agreed`: the change was agreed at
  // a commit (a worker restarts or leaves there after HostsUpdatedInterrupt),
  // so every member restarts on its own once its part of that commit's
  // agreement is back; otherwise (a loss, a failure) each is told
  // (WORKERS_CHANGED), which fails its pending operations.
  void StartEpoch(const std::string& why, const Peer* lost, std::vector<Outgoing>* out,
                  bool agreed = false);
  // Once the survivors are back (or gone: see SurvivorsOnTheirWay): dense ranks,
  // the servers start the epoch, then the workers' WELCOME.
  void MaybeFinishEpoch(std::vector<Outgoing>* out);
  // Whether an expected survivor may still come back: heard of within
  // BYTEPS_TIMEOUT, for at most half the rendezvous timeout in all.
  bool SurvivorsOnTheirWay() const;
  // MaybeFinishEpoch's steps: the first `newcomers` waiting workers become
  // members (in the launcher's planned order, then by arrival); every
  // member gets its dense rank and the worker count follows.
  void AdmitNewcomers(int newcomers);
  void RankWorkers();
  void OnEpochStarted(const Node& server, const Config& kv, std::vector<Outgoing>* out);
  void WelcomeWorkers(std::vector<Outgoing>* out);
  void TellWaiting(std::vector<Outgoing>* out);  // kHostsUpdated to the workers
  void TickElastic(std::vector<Outgoing>* out);
  int WorkerCount() const;
  // How long an epoch that a failure started waits for the launcher's
  // report of it (see verdicts_).
  static constexpr double kVerdictWaitS = 10;
  // A launcher's messages and the workers' leave requests
  // (scheduler_control.cc). The launcher reports the processes it saw end
  // ("lost=") with what it removes because of it ("remove="), the newcomers
  // it started ("announce="); the scheduler tells it each epoch's members.
  void OnControl(const Peer& from, const Config& kv, std::vector<Outgoing>* out);
  void OnLeaveRequest(Node* node, std::vector<Outgoing>* out);
  // The worker with this launch id leaves: at the next commit (a member),
  // at once (a survivor not back yet, a newcomer); false if none has it.
  bool Remove(const std::string& id, const std::string& why, std::vector<Outgoing>* out);
  void Lost(const std::string& id, const std::string& why, std::vector<Outgoing>* out);
  // kHostsUpdated to every member: workers were added (flags 2) or will
  // leave (1); each update has a number and a time, both rising.
  void NotifyHosts(int flags, std::vector<Outgoing>* out);
  // Forms the epoch again under a new number when the servers were told a
  // worker count that no longer holds.
  void Reform(std::vector<Outgoing>* out);
  void TellLauncher(const Config& kv, std::vector<Outgoing>* out);
  std::string Members() const;  // the members' launch ids, by rank
  static std::string KeyOf(const Node& n);  // launch id, or host/pid without one
  Assignment Assign(const std::string& name, const std::string& sig, int dtype, uint64_t bytes);
  // Each partition of a tensor of `bytes` to the server with the fewest
  // bytes so far (server_load_).
  std::vector<int> Place(int dtype, uint64_t bytes);

  // Elastic servers (scheduler_servers.cc). A server that is lost, leaves
  // or joins changes the membership as a worker does: the epoch that
  // follows places every key again on its servers, balanced by bytes.
  // Servers keep their ids (sparse once one is gone); a worker reaches
  // them by their place in ServersInOrder().
  void OnServerHello(const Peer& from, const Node& n, const Config& kv,
                     std::vector<Outgoing>* out);
  void LoseServer(const Peer& peer, const std::string& why, std::vector<Outgoing>* out);
  // The launcher saw the server with this launch id end; false if none has it.
  bool LostServer(const std::string& id, const std::string& why, std::vector<Outgoing>* out);
  void OnServerLeave(const Node& server, std::vector<Outgoing>* out);
  // A worker's notice that its link to a server broke ("server=", "epoch=").
  void OnServerGone(const Node& worker, const Config& kv, std::vector<Outgoing>* out);
  void TickServers(std::vector<Outgoing>* out);
  // Whether the next epoch can form now: a restarted scheduler has heard
  // enough, and there is a server to place keys on (the job fails when
  // none came within --elastic-timeout).
  bool ReadyToForm(std::vector<Outgoing>* out);
  // At the forming: leaving servers go, joining ones are welcomed, keys
  // are placed again when the servers changed.
  void SettleServers(std::vector<Outgoing>* out);
  // HostsUpdatedInterrupt at the next commit: flags 2 a server joins, 1 one leaves.
  void AnnounceServers(int flags, std::vector<Outgoing>* out);
  std::vector<const Node*> ServersInOrder() const;
  int ServerCount() const;
  void PlaceAgain();
  // A restarted scheduler (scheduler_recover.cc): a node's HELLO with
  // "recover=1" says what it was doing when it lost the scheduler.
  void OnRecoverHello(const Peer& from, const Node& n, const Config& kv,
                      std::vector<Outgoing>* out);
  void BeginRecovery();
  // The same HELLO at a scheduler that never went away: the node's link broke.
  void Relinked(const Peer& from, const Node& n, const Config& kv, std::vector<Outgoing>* out);
  // A recovering server that reported already, reporting again: its link is updated.
  bool ReportedAgain(const Peer& from, const Node& n, std::vector<Outgoing>* out);
  // The member that is the same process as `n` (role, id, pid, host), now
  // reached on `from`; null when there is none.
  const Node* MoveToLink(const Peer& from, const Node& n);

  Config cfg_;
  int num_workers_;
  int num_servers_;
  int64_t partition_bytes_;
  double timeout_s_;
  double stall_check_s_;     // report a declaration some workers never made (0: off)
  double stall_shutdown_s_;  // ... and stop the job after this long (0: never)
  std::map<Peer, Node> nodes_;
  bool welcomed_ = false;
  std::set<Peer> barrier_;
  std::map<std::string, std::map<int, Pending>> pending_;      // name -> rank -> declaration
  std::map<std::string, Clock::time_point> pending_since_;     // name -> first declaration
  std::set<std::string> stall_reported_;
  std::map<std::string, SetConflict> set_conflicts_;            // name -> conflict
  std::set<int> joined_;  // workers in join(), until every worker is
  std::vector<std::pair<int, uint64_t>> join_order_;  // (rank, seen) as notices arrived
  std::map<std::string, Assignment> assigned_;                 // name|sig -> assignment
  std::map<std::string, std::string> async_sig_;               // async name -> its sig
  std::set<uint64_t> used_keys_;
  std::set<int> host_roots_;  // the lowest rank of each host: who declares a host sum
  std::vector<uint64_t> server_load_;
  double report_every_s_;  // ReportMissing's period
  double rendezvous_s_;    // BYTEPS_RENDEZVOUS_TIMEOUT (<= 0: no limit of its own)
  Clock::time_point started_ = Clock::now();
  Clock::time_point last_report_ = Clock::now();
  bool finished_ = false;
  std::string failure_;  // the reasons workers gave for leaving, in order
  std::string fatal_;

  // Elastic membership (BYTEPS_ELASTIC=1).
  bool elastic_ = false;
  int min_workers_ = 1, max_workers_ = 1;
  double elastic_timeout_s_ = 600;
  int epoch_ = 0;
  bool changing_ = false;         // between StartEpoch and the workers' WELCOME
  bool servers_starting_ = false;  // the servers were told the new epoch
  std::set<int> servers_started_;
  Clock::time_point change_since_;
  std::string change_why_;
  std::set<int> expected_;           // survivors' previous ranks not back yet
  std::map<Peer, Node> waiting_;      // newcomers, admitted at the next epoch
  std::vector<Peer> waiting_order_;
  int next_arrival_ = 0;
  std::map<int, std::string> expected_ids_;  // survivors not back yet: old rank -> key
  // Survivors' old links (-> old rank), and when each survivor was last
  // heard of there (a heartbeat, or the goodbye of its restart): one still
  // heard of is on its way back.
  std::map<Peer, int> old_links_;
  std::map<int, Clock::time_point> heard_from_;
  Peer launcher_;  // the launcher's link (bpslaunch), once it said hello
  std::map<std::string, Clock::time_point> announced_;  // newcomers the launcher started
  std::set<std::string> awaited_;   // ... that the forming epoch waits for
  std::set<std::string> removed_;   // told to leave: a HELLO of theirs gets kLeave
  // A failure the launcher has not reported yet (its key, since when): the
  // epoch waits for its report, which names the workers removed with it.
  std::map<std::string, Clock::time_point> verdicts_;
  uint64_t update_seq_ = 0;
  int64_t update_ms_ = 0;
  int resets_ = 0;
  int reset_limit_ = -1;    // BYTEPS_ELASTIC_RESET_LIMIT; -1: none
  double newcomer_wait_s_;  // for announced newcomers: BYTEPS_RENDEZVOUS_TIMEOUT

  // Elastic servers and a restarted scheduler (scheduler_servers.cc,
  // scheduler_recover.cc).
  std::map<Peer, Node> joining_servers_;  // admitted at the next epoch
  std::set<int> leaving_servers_;         // ids that leave at the next epoch
  bool placement_stale_ = false;          // the servers changed since keys were placed
  bool recovering_ = false;               // a restarted scheduler, until its first epoch
  int recover_servers_ = 0;               // servers the workers' last epoch had
  std::set<int> recover_ranks_;           // ranks a restarted scheduler heard of
  Clock::time_point no_server_since_{};   // when the last server was lost
};

}  // namespace bps

#endif  // BPS_TF_CORE_SCHEDULER_SCHEDULER_H_
