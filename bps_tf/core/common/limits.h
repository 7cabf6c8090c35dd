// Per-process limits a large job reaches before anything else: open files.
// Every worker holds a connection to each server and one to the scheduler,
// so a server's descriptors grow with the worker count, and the scheduler's
// with the node count; a process that runs out fails its accept() calls
// silently inside libzmq (the peer's messages just wait).
#ifndef BPS_TF_CORE_COMMON_LIMITS_H_
#define BPS_TF_CORE_COMMON_LIMITS_H_

#include <string>

namespace bps {

// Descriptors a process needs besides its peers' connections: libzmq's
// own (a mailbox per socket, a poller per I/O thread), the interpreter's
// files and libraries, a TensorFlow worker's thread pools and files.
constexpr long kBaseOpenFiles = 256;

// Makes sure this process may hold `needed` open files: raises the soft
// RLIMIT_NOFILE (up to the hard one) when it is lower. Throws Error naming
// both numbers and the way out when even the hard limit is lower. `what`
// says who needs them, e.g. "server 0 of 1024 workers". Returns the soft
// limit in force afterwards.
long EnsureOpenFiles(long needed, const std::string& what);

}  // namespace bps

#endif  // BPS_TF_CORE_COMMON_LIMITS_H_
