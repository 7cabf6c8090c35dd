#include "transport/local_links.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <mutex>
#include <random>
#include <vector>

#include "transport/transport.h"

namespace bps {

std::string NetnsLink() {
  char netns[64] = {0};
  ssize_t len = readlink("/proc/self/ns/net", netns, sizeof(netns) - 1);
  return len > 0 ? std::string(netns, static_cast<size_t>(len)) : "";
}

std::string MachineNetnsId() {
  std::string boot;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  if (!std::getline(in, boot) || boot.empty()) return "";
  std::string netns = NetnsLink();
  return netns.empty() ? "" : boot + " " + netns;
}

namespace {
constexpr char kServerSocketPrefix[] = "@bps_tf-server-";

// The names /proc/net/unix lists that start with `prefix` ("@..." for
// abstract ones), or the one equal to `only` when it is not empty.
std::set<std::string> ListedNames(const std::string& prefix, const std::string& only) {
  std::set<std::string> names;
  std::ifstream in("/proc/net/unix");
  std::string line;
  while (std::getline(in, line)) {
    size_t space = line.find_last_of(' ');
    if (space == std::string::npos) continue;
    if (only.empty() ? line.compare(space + 1, prefix.size(), prefix) == 0
                     : line.compare(space + 1, std::string::npos, only) == 0) {
      names.insert(line.substr(space + 1));
      if (!only.empty()) break;
    }
  }
  return names;
}
}  // namespace

std::string NewServerSocketEndpoint() {
  std::random_device rd;
  char name[96];
  std::snprintf(name, sizeof(name), "ipc://%s%d-%08x%08x", kServerSocketPrefix,
                static_cast<int>(getpid()), rd(), rd());
  return name;
}

bool AbstractEndpointListed(const std::string& endpoint) {
  if (!IsIpcEndpoint(endpoint) || endpoint.compare(6, 1, "@") != 0) return false;
  return !ListedNames("", endpoint.substr(6)).empty();  // "@...", as /proc/net/unix lists it
}

namespace {
// Server s's Unix-socket endpoint from the WELCOME when the server runs on
// `machine` (MachineNetnsId()), else "".
std::string SameMachineSocket(const Config& welcome, int s, const std::string& machine) {
  const std::string key = "server." + std::to_string(s);
  const std::string ipc = welcome.Get(key + ".local");
  const bool same = !machine.empty() && !ipc.empty() && welcome.Get(key + ".machine") == machine;
  return same ? ipc : "";
}
}  // namespace

std::set<std::string> ListedServerSockets(const Config& welcome, int num_servers,
                                          const std::string& machine) {
  std::vector<std::string> wanted;  // "@..." names, as /proc/net/unix lists them
  for (int s = 0; s < num_servers; ++s) {
    const std::string ipc = SameMachineSocket(welcome, s, machine);
    if (IsIpcEndpoint(ipc)) wanted.push_back(ipc.substr(6));
  }
  static std::mutex mu;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lock(mu);
  bool known = !wanted.empty();
  for (const auto& name : wanted) known = known && seen.count(name) != 0;
  if (!known) {
    std::set<std::string> listed = ListedNames(kServerSocketPrefix, "");
    seen.insert(listed.begin(), listed.end());
  }
  return seen;
}

std::string UnixLinkGaveUp(const std::string& endpoint) {
  return "could not connect to the Unix socket " + endpoint +
         ": its queue of connections waiting to be accepted was full (the kernel's "
         "net.core.somaxconn is " + std::to_string(KernelListenBacklog()) +
         ") or the server is gone; raise net.core.somaxconn above the number of workers, or "
         "set BYTEPS_ENABLE_IPC=0 to reach servers over TCP";
}

std::string ServerEndpoint(const Config& welcome, int s, const std::string& machine,
                           bool* local, const std::set<std::string>* listed) {
  const std::string ipc = SameMachineSocket(welcome, s, machine);
  *local = !ipc.empty();
  const bool found = listed ? IsIpcEndpoint(ipc) && listed->count(ipc.substr(6)) != 0
                            : AbstractEndpointListed(ipc);
  if (*local && !found) {
    BPS_LOG(kWarning, "server " << s << "'s Unix socket " << ipc
                                 << " is not visible here; reaching it over TCP");
    *local = false;
  }
  return *local ? ipc : welcome.Get("server." + std::to_string(s));
}

}  // namespace bps
