#include "common/limits.h"

#include <sys/resource.h>

#include <cerrno>
#include <cstring>

#include "common/common.h"

namespace bps {

long EnsureOpenFiles(long needed, const std::string& what) {
  struct rlimit lim {};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return -1;  // nothing known: let the job try
  const rlim_t want = static_cast<rlim_t>(needed);
  if (lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur < want) {
    if (lim.rlim_max != RLIM_INFINITY && lim.rlim_max < want) {
      throw Error(what + " needs about " + std::to_string(needed) +
                  " open files (a connection per peer), but this process may open at most " +
                  std::to_string(static_cast<long>(lim.rlim_max)) +
                  " (hard RLIMIT_NOFILE): raise the hard limit (ulimit -Hn " +
                  std::to_string(needed) + " as root, LimitNOFILE= in systemd, "
                  "--ulimit nofile= in Docker)");
    }
    // Raising the soft limit up to the hard one needs no privilege; the
    // common default of 1024 is below what a server of ~1,000 workers holds.
    struct rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) != 0) {
      throw Error(what + " needs about " + std::to_string(needed) +
                  " open files, but raising the soft limit from " +
                  std::to_string(static_cast<long>(lim.rlim_cur)) + " failed (" +
                  std::strerror(errno) + "): raise it with ulimit -n before starting");
    }
    BPS_LOG(kInfo, "raised the open-file limit from " << lim.rlim_cur << " to "
                                                       << raised.rlim_cur << " (" << what
                                                       << " needs about " << needed << ")");
    lim = raised;
  }
  return lim.rlim_cur == RLIM_INFINITY ? -1 : static_cast<long>(lim.rlim_cur);
}

}  // namespace bps
