// bpslaunch's link to the scheduler of an elastic job (docs/elastic.md):
// the launcher reports what it sees and does (a process that ended, the
// workers it removes, the newcomers it starts) and hears what the
// scheduler formed (each epoch's members, a worker that left, the job's end
// or failure). One connection, authenticated and sealed like every link of
// the job (BYTEPS_JOB_TOKEN); messages are kControl with key=value text.
// Used from one thread (the launcher's supervision loop).
#ifndef BPS_TF_CORE_SCHEDULER_LAUNCHER_LINK_H_
#define BPS_TF_CORE_SCHEDULER_LAUNCHER_LINK_H_

#include <memory>
#include <string>
#include <vector>

#include "common/common.h"
#include "transport/channel.h"

namespace bps {

class LauncherLink {
 public:
  // cfg: the security settings (link_security, ...) and the scheduler's
  // scheduler_host and scheduler_port. Says hello at once.
  explicit LauncherLink(const Config& cfg);
  ~LauncherLink();
  void Send(const std::string& text);
  // The scheduler's messages that arrived within timeout_ms (each as text).
  std::vector<std::string> Receive(int timeout_ms);
  // Why the scheduler refused the link ("" while it did not).
  std::string Refusal() const;
  void Close();

 private:
  Wakeup wake_;
  std::unique_ptr<Channel> channel_;
  Peer scheduler_;
};

}  // namespace bps

#endif  // BPS_TF_CORE_SCHEDULER_LAUNCHER_LINK_H_
