// Which servers a worker can reach over an abstract Unix socket (ZeroMQ
// ipc://@name) instead of loopback TCP: a server names its socket and its
// machine, the scheduler passes both on in the WELCOME, and a worker picks
// per server which endpoint to use (BYTEPS_ENABLE_IPC, docs/engine.md).
#ifndef BPS_TF_CORE_TRANSPORT_LOCAL_LINKS_H_
#define BPS_TF_CORE_TRANSPORT_LOCAL_LINKS_H_

#include <set>
#include <string>

#include "common/common.h"

namespace bps {

// This process's network namespace as /proc/self/ns/net names it, "" if
// unknown.
std::string NetnsLink();

// The kernel and network namespace this process runs in, "" if unknown.
// Processes with the same id can reach each other's abstract Unix sockets:
// the boot id tells machines apart (a machine's containers share it), the
// namespace tells apart the emulated hosts of one machine.
std::string MachineNetnsId();

// A fresh ipc:// endpoint for a server: its pid and 64 random bits, so two
// jobs' servers never meet. Throws what std::random_device throws.
std::string NewServerSocketEndpoint();

// Whether an "ipc://@name" endpoint is listening in this network namespace
// (listed in /proc/net/unix), so a connection to it cannot wait forever on
// a name that only looked local.
bool AbstractEndpointListed(const std::string& endpoint);

// Every servers' Unix socket listed in /proc/net/unix ("@bps_tf-server-..."),
// read once: the file lists every Unix socket of the namespace, so reading
// it per server cost each of N workers S reads of O(N x S) lines. Names
// this process saw listed before count as listed, and the file is read
// only when the socket of one of the WELCOME's servers on `machine`
// (MachineNetnsId()) is not among them: a name holds
// its server's pid and 64 random bits, so it is that server's for good,
// and a restarted membership (elastic) that reaches the same servers reads
// nothing (at 256 workers + 32 servers the file has 16,000 lines).
std::set<std::string> ListedServerSockets(const Config& welcome, int num_servers,
                                          const std::string& machine);

// Why a Unix-socket link this node opened was lost before it ever
// connected (libzmq never retries one, channel.cc): the listener's queue
// was full or the server is gone; names net.core.somaxconn and the way out.
std::string UnixLinkGaveUp(const std::string& endpoint);

// Where a worker reaches server s, from the scheduler's WELCOME: the
// server's Unix socket when it has this machine's id (`machine`:
// MachineNetnsId(), "" for TCP only) and is listed here, else its TCP
// endpoint. *local says which. `listed`: ListedServerSockets(), else the
// listing is read for this server alone.
std::string ServerEndpoint(const Config& welcome, int s, const std::string& machine, bool* local,
                           const std::set<std::string>* listed = nullptr);

}  // namespace bps

#endif  // BPS_TF_CORE_TRANSPORT_LOCAL_LINKS_H_
