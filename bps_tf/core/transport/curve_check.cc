#include "transport/curve_check.h"

#include <elf.h>
#include <link.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <vector>

#include "common/common.h"
#include "transport/transport.h"

namespace bps {

namespace {

constexpr double kSlowCurveMBs = 40;

struct ModuleSearch {
  uintptr_t address;
  std::string path;
};

int FindModule(struct dl_phdr_info* info, size_t, void* data) {
  ModuleSearch* s = static_cast<ModuleSearch*>(data);
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    uintptr_t start = info->dlpi_addr + ph.p_vaddr;
    if (ph.p_type == PT_LOAD && s->address >= start && s->address < start + ph.p_memsz) {
      s->path = info->dlpi_name ? info->dlpi_name : "";
      return 1;
    }
  }
  return 0;
}

// The libraries an ELF64 file names in its dynamic section (DT_NEEDED),
// read from the file: the loaded copy's dynamic section may be relocated.
std::vector<std::string> NeededLibraries(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  const std::string d((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::string> out;
  Elf64_Ehdr eh;
  if (d.size() < sizeof(eh) || d.compare(0, SELFMAG, ELFMAG) != 0 || d[EI_CLASS] != ELFCLASS64) {
    return out;
  }
  std::memcpy(&eh, d.data(), sizeof(eh));
  auto section = [&](size_t i, Elf64_Shdr* sh) {
    size_t at = eh.e_shoff + i * eh.e_shentsize;
    if (eh.e_shentsize < sizeof(*sh) || at + sizeof(*sh) > d.size()) return false;
    std::memcpy(sh, d.data() + at, sizeof(*sh));
    return sh->sh_offset + sh->sh_size <= d.size();
  };
  for (size_t i = 0; i < eh.e_shnum; ++i) {
    Elf64_Shdr dyn, str;
    if (!section(i, &dyn) || dyn.sh_type != SHT_DYNAMIC || !section(dyn.sh_link, &str)) continue;
    for (size_t k = 0; k + sizeof(Elf64_Dyn) <= dyn.sh_size; k += sizeof(Elf64_Dyn)) {
      Elf64_Dyn e;
      std::memcpy(&e, d.data() + dyn.sh_offset + k, sizeof(e));
      // Names end with a NUL inside the table (and std::string ends with one).
      if (e.d_tag == DT_NEEDED && e.d_un.d_val < str.sh_size) {
        out.emplace_back(d.c_str() + str.sh_offset + e.d_un.d_val);
      }
    }
  }
  return out;
}

void Set(Socket& s, int option, const void* value, size_t size) {
  if (zmq_setsockopt(s.get(), option, value, size) != 0) throw Error(ZmqError("curve probe"));
}

// MB/s of `count` messages of `bytes` from a DEALER to a ROUTER over loopback
// TCP in one context (one I/O thread encrypts and decrypts), 0 if they do not
// arrive within 10 s.
double Throughput(bool curve, size_t bytes, int count) {
  Context ctx(1);
  Socket server(ctx, zmqc::kRouter), client(ctx, zmqc::kDealer);
  if (curve) {
    char server_public[41], server_secret[41], client_public[41], client_secret[41];
    if (zmq_curve_keypair(server_public, server_secret) != 0 ||
        zmq_curve_keypair(client_public, client_secret) != 0) {
      throw Error(ZmqError("curve probe keys"));
    }
    int one = 1;
    Set(server, zmqc::kCurveServer, &one, sizeof(one));
    Set(server, zmqc::kCurveSecretKey, server_secret, 40);
    Set(client, zmqc::kCurveServerKey, server_public, 40);
    Set(client, zmqc::kCurvePublicKey, client_public, 40);
    Set(client, zmqc::kCurveSecretKey, client_secret, 40);
  }
  client.Connect(server.Bind("tcp://127.0.0.1:0"));
  std::vector<Msg> frames;
  auto deadline = Clock::now() + std::chrono::seconds(10);
  auto receive = [&](int n) {
    zmq_pollitem_t item{server.get(), 0, zmqc::kPollIn, 0};
    while (n > 0 && Clock::now() < deadline) {
      zmq_poll(&item, 1, 100);
      while (n > 0 && server.RecvFrames(&frames)) --n;
    }
    return n == 0;
  };
  frames.emplace_back("w", 1);  // through the handshake first
  client.SendFrames(&frames);
  if (!receive(1)) return 0;
  auto start = Clock::now();
  for (int i = 0; i < count; ++i) {
    frames.clear();
    frames.emplace_back(bytes);
    client.SendFrames(&frames);
  }
  if (!receive(count)) return 0;
  return static_cast<double>(bytes) * count / SecondsSince(start) / 1e6;
}

}  // namespace

bool CurveBackend::slow() const {
  // This probe measured 12-25 MB/s with TweetNaCl and 124-191 MB/s with
  // libsodium on a loaded 2-core machine (both ends in one I/O thread).
  return measured && curve_mb_s < kSlowCurveMBs;
}

CurveBackend CheckCurveBackend(bool measure) {
  CurveBackend b;
  ModuleSearch search{reinterpret_cast<uintptr_t>(&zmq_has), ""};
  dl_iterate_phdr(&FindModule, &search);
  b.libzmq = search.path;
  for (const std::string& name : NeededLibraries(b.libzmq)) {
    if (name.find("libsodium") != std::string::npos) b.links_libsodium = true;
  }
  if (measure && !b.links_libsodium && zmq_has("curve")) {
    b.measured = true;
    b.clear_mb_s = Throughput(false, 1 << 20, 4);
    b.curve_mb_s = Throughput(true, 1 << 20, 2);
  }
  return b;
}

std::string CurveSlowWarning() {
  static const std::string warning = [] {
    CurveBackend b = CheckCurveBackend(true);
    if (!b.slow()) return std::string();
    std::ostringstream o;
    o << "BYTEPS_ENCRYPTION=curve: the loaded libzmq (" << b.libzmq
      << ") links no libsodium, and its CURVE moved " << static_cast<int>(b.curve_mb_s)
      << " MB/s here against " << static_cast<int>(b.clear_mb_s)
      << " MB/s in clear: it encrypts with the TweetNaCl libzmq bundles, so every "
         "encrypted push_pull runs about that much slower. Use BYTEPS_ENCRYPTION=1 (sealed "
         "links on libsodium, whatever libzmq was built with), or a libzmq built with "
         "libsodium (pyzmq's wheel: pip install --force-reinstall --only-binary pyzmq pyzmq)";
    return o.str();
  }();
  return warning;
}

}  // namespace bps
