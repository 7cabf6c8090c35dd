// The raw-TCP bound of a push_pull's data movement, without Python in the way
// (and the Unix-socket bound, for workers and servers of one machine).
//
//   ps_echo server HOST PORT_FILE
//     HOST "unix": listens on an abstract Unix socket instead and writes
//     "unix:NAME" to PORT_FILE (clients take that as the server's address).
//     Accepts any number of connections and streams every byte it receives
//     back on the same connection (no summation: this is the data movement
//     alone). One thread per connection, non-blocking socket, poll() on both
//     directions with a ring buffer in between, so a connection receives and
//     sends at once, as a bps_tf server does.
//
//   ps_echo client RANK CLIENTS BARRIER_DIR OUT_JSON SERVERS CASES
//     SERVERS: host:port,host:port,...   CASES: label:bytes:warmup:reps,...
//     Per repetition, sends the case's bytes split evenly over the servers and
//     receives them back, all connections at once (what a worker's push then
//     pull of M bytes against S servers moves): one poll() loop for small
//     shares, a thread per connection from 1 MiB per connection up. A file
//     barrier (the same protocol as benchmarks/common.py file_barrier_fn)
//     aligns the CLIENTS clients before each repetition. Times are
//     CLOCK_MONOTONIC seconds, comparable with Python's perf_counter.
//     Writes {"rank", "cases": [{"label", "bytes", "starts", "ends"}]}.
//
// Built by benchmarks/cxx_echo.py with g++ -O2 -pthread; no other dependency.
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr size_t kRingBytes = 8 << 20;  // per server connection: bounds memory, is the flow control
// From this share per connection up, the client gives each connection a
// thread of its own (the kernel's copies then run on several cores); below,
// one poll() loop is cheaper than starting threads.
constexpr size_t kThreadedShare = 1 << 20;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "ps_echo: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(1);
}

double Now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

void SetNonBlocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) Die("fcntl");
}

void SetNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

std::vector<std::string> Split(const std::string& text, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, sep)) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// ---------------------------------------------------------------- server
void ServeConnection(int fd) {
  SetNonBlocking(fd);
  std::vector<char> ring(kRingBytes);
  size_t head = 0, used = 0;  // bytes [head, head + used) wait to go back
  bool eof = false;
  while (!(eof && used == 0)) {
    pollfd p{fd, 0, 0};
    if (!eof && used < kRingBytes) p.events |= POLLIN;
    if (used > 0) p.events |= POLLOUT;
    if (poll(&p, 1, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (p.revents & (POLLERR | POLLNVAL)) break;
    if (p.revents & POLLOUT) {
      size_t n = std::min(used, kRingBytes - head);
      ssize_t s = send(fd, ring.data() + head, n, MSG_NOSIGNAL);
      if (s < 0 && errno != EAGAIN && errno != EINTR) break;
      if (s > 0) {
        head = (head + s) % kRingBytes;
        used -= s;
      }
    }
    if (p.revents & (POLLIN | POLLHUP)) {
      size_t tail = (head + used) % kRingBytes;
      size_t n = std::min(kRingBytes - used, kRingBytes - tail);
      ssize_t r = recv(fd, ring.data() + tail, n, 0);
      if (r == 0) eof = true;
      if (r < 0 && errno != EAGAIN && errno != EINTR) break;
      if (r > 0) used += r;
    }
  }
  close(fd);
}

// An abstract socket address (a leading NUL): no file, gone with the process.
socklen_t AbstractAddress(const std::string& name, sockaddr_un* addr) {
  *addr = sockaddr_un{};
  addr->sun_family = AF_UNIX;
  if (name.size() + 1 > sizeof(addr->sun_path)) Die("unix socket name too long: " + name);
  std::memcpy(addr->sun_path + 1, name.data(), name.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

void WritePortFile(const char* port_file, const std::string& text) {
  std::string tmp = std::string(port_file) + ".tmp";
  {
    std::ofstream f(tmp);
    f << text;
  }
  if (rename(tmp.c_str(), port_file) < 0) Die("rename");
}

[[noreturn]] void AcceptForever(int listener) {
  for (;;) {
    int fd = accept(listener, nullptr, nullptr);
    if (fd < 0) {
      if (errno == EINTR) continue;
      Die("accept");
    }
    SetNoDelay(fd);
    std::thread(ServeConnection, fd).detach();
  }
}

int Server(const char* host, const char* port_file) {
  if (std::strcmp(host, "unix") == 0) {
    int listener = socket(AF_UNIX, SOCK_STREAM, 0);
    if (listener < 0) Die("socket");
    std::string name = "ps_echo-" + std::to_string(getpid());
    sockaddr_un addr;
    socklen_t len = AbstractAddress(name, &addr);
    if (bind(listener, reinterpret_cast<sockaddr*>(&addr), len) < 0) Die("bind " + name);
    if (listen(listener, 128) < 0) Die("listen");
    WritePortFile(port_file, "unix:" + name);
    AcceptForever(listener);
  }
  int listener = socket(AF_INET, SOCK_STREAM, 0);
  if (listener < 0) Die("socket");
  int one = 1;
  setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  if (inet_pton(AF_INET, host, &addr.sin_addr) != 1) Die(std::string("bad address ") + host);
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) < 0) Die("bind");
  if (listen(listener, 128) < 0) Die("listen");
  socklen_t len = sizeof(addr);
  getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  WritePortFile(port_file, std::to_string(ntohs(addr.sin_port)));
  AcceptForever(listener);
}

// ---------------------------------------------------------------- client
struct Case {
  std::string label;
  size_t bytes = 0;
  int warmup = 0, reps = 0;
};

int Connect(const std::string& address) {
  if (address.compare(0, 5, "unix:") == 0) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0) Die("socket");
    sockaddr_un addr;
    socklen_t len = AbstractAddress(address.substr(5), &addr);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), len) < 0) Die("connect to " + address);
    SetNonBlocking(fd);
    return fd;
  }
  size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    errno = EINVAL;
    Die("server address without a port: " + address);
  }
  std::string host = address.substr(0, colon), port = address.substr(colon + 1);
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) {
    Die("cannot resolve " + address);
  }
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) Die("socket");
  if (connect(fd, res->ai_addr, res->ai_addrlen) < 0) Die("connect to " + address);
  freeaddrinfo(res);
  SetNoDelay(fd);
  SetNonBlocking(fd);
  return fd;
}

void Barrier(const std::string& dir, int round, int rank, int parties) {
  auto name = [&](int r) {
    return dir + "/barrier." + std::to_string(round) + "." + std::to_string(r);
  };
  std::ofstream(name(rank)).close();
  for (int r = 0; r < parties; ++r) {
    struct stat st;
    while (stat(name(r).c_str(), &st) != 0) usleep(500);
  }
}

// Sends share bytes on every connection and receives share bytes back.
void Exchange(const std::vector<int>& fds, const char* src, char* dst, size_t share) {
  size_t n = fds.size();
  std::vector<size_t> sent(n, 0), got(n, 0);
  std::vector<pollfd> polls(n);
  size_t open = n;
  while (open > 0) {
    for (size_t i = 0; i < n; ++i) {
      polls[i].fd = fds[i];
      polls[i].events = (sent[i] < share ? POLLOUT : 0) | (got[i] < share ? POLLIN : 0);
      polls[i].revents = 0;
    }
    if (poll(polls.data(), n, -1) < 0) {
      if (errno == EINTR) continue;
      Die("poll");
    }
    open = 0;
    for (size_t i = 0; i < n; ++i) {
      const char* out = src + i * share;
      char* in = dst + i * share;
      if (polls[i].revents & (POLLERR | POLLNVAL)) {
        errno = ECONNRESET;
        Die("connection " + std::to_string(i));
      }
      if ((polls[i].revents & POLLOUT) && sent[i] < share) {
        ssize_t s = send(fds[i], out + sent[i], share - sent[i], MSG_NOSIGNAL);
        if (s < 0 && errno != EAGAIN && errno != EINTR) Die("send");
        if (s > 0) sent[i] += s;
      }
      if ((polls[i].revents & (POLLIN | POLLHUP)) && got[i] < share) {
        ssize_t r = recv(fds[i], in + got[i], share - got[i], 0);
        if (r == 0) {
          errno = ECONNRESET;
          Die("echo server closed connection " + std::to_string(i));
        }
        if (r < 0 && errno != EAGAIN && errno != EINTR) Die("recv");
        if (r > 0) got[i] += r;
      }
      if (sent[i] < share || got[i] < share) ++open;
    }
  }
}

void ExchangeAll(const std::vector<int>& fds, const char* src, char* dst, size_t share) {
  if (share < kThreadedShare || fds.size() == 1) {
    Exchange(fds, src, dst, share);
    return;
  }
  std::vector<std::thread> threads;
  for (size_t i = 0; i < fds.size(); ++i) {
    threads.emplace_back([&, i] { Exchange({fds[i]}, src + i * share, dst + i * share, share); });
  }
  for (auto& t : threads) t.join();
}

std::string Join(const std::vector<double>& v) {
  std::ostringstream out;
  out.precision(17);
  for (size_t i = 0; i < v.size(); ++i) out << (i ? ", " : "") << v[i];
  return out.str();
}

int Client(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr,
                 "usage: ps_echo client RANK CLIENTS BARRIER_DIR OUT_JSON SERVERS CASES\n");
    return 2;
  }
  int rank = std::atoi(argv[2]), clients = std::atoi(argv[3]);
  std::string barrier_dir = argv[4], out_path = argv[5];
  std::vector<Case> cases;
  for (const auto& text : Split(argv[7], ',')) {
    auto f = Split(text, ':');
    if (f.size() != 4) {
      std::fprintf(stderr, "ps_echo: case %s is not label:bytes:warmup:reps\n", text.c_str());
      return 2;
    }
    try {
      cases.push_back({f[0], std::stoull(f[1]), std::stoi(f[2]), std::stoi(f[3])});
    } catch (const std::exception&) {
      std::fprintf(stderr, "ps_echo: case %s: bytes, warmup and reps must be numbers\n",
                   text.c_str());
      return 2;
    }
    if (cases.back().bytes == 0 || cases.back().warmup < 0 || cases.back().reps < 1) {
      std::fprintf(stderr, "ps_echo: case %s: needs bytes > 0, warmup >= 0, reps >= 1\n",
                   text.c_str());
      return 2;
    }
  }
  std::vector<int> fds;
  for (const auto& address : Split(argv[6], ',')) fds.push_back(Connect(address));
  if (fds.empty() || cases.empty() || clients < 1) {
    std::fprintf(stderr, "ps_echo: no servers, no cases or no clients\n");
    return 2;
  }
  std::ostringstream json;
  json << "{\"rank\": " << rank << ", \"cases\": [";
  int round = 0;
  for (size_t c = 0; c < cases.size(); ++c) {
    const Case& k = cases[c];
    size_t share = (k.bytes + fds.size() - 1) / fds.size();
    std::vector<char> src(share * fds.size(), 1), dst(share * fds.size(), 0);
    std::vector<double> starts, ends;
    for (int r = 0; r < k.warmup + k.reps; ++r) {
      Barrier(barrier_dir, round++, rank, clients);
      double t0 = Now();
      ExchangeAll(fds, src.data(), dst.data(), share);
      double t1 = Now();
      if (r >= k.warmup) {
        starts.push_back(t0);
        ends.push_back(t1);
      }
    }
    json << (c ? ", " : "") << "{\"label\": \"" << k.label << "\", \"bytes\": " << src.size()
         << ", \"starts\": [" << Join(starts) << "], \"ends\": [" << Join(ends) << "]}";
  }
  json << "]}\n";
  for (int fd : fds) close(fd);
  std::string tmp = out_path + ".tmp";
  {
    std::ofstream f(tmp);
    f << json.str();
    if (!f) Die("write " + tmp);
  }
  if (rename(tmp.c_str(), out_path.c_str()) < 0) Die("rename");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 4 && std::strcmp(argv[1], "server") == 0) return Server(argv[2], argv[3]);
  if (argc >= 2 && std::strcmp(argv[1], "client") == 0) return Client(argc, argv);
  std::fprintf(stderr,
               "usage: ps_echo server HOST PORT_FILE | "
               "ps_echo client RANK CLIENTS BARRIER_DIR OUT_JSON SERVERS CASES\n");
  return 2;
}
