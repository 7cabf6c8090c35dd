#include "transport/aead_suites.h"

namespace bps {

namespace {

// A suite whose functions this libsodium has, with sizes the code can hold.
bool Usable(const SodiumAead& a, Suite id, SuiteOps* out) {
  if (!a.encrypt || !a.decrypt || !a.keybytes || !a.npubbytes || !a.abytes) return false;
  if (a.is_available && !a.is_available()) return false;  // AES-256-GCM without AES-NI
  *out = SuiteOps{id, a.encrypt, a.decrypt, a.keybytes(), a.npubbytes(), a.abytes()};
  return out->key >= 16 && out->key <= kLinkKeyBytes && out->npub >= 12 &&
         out->npub <= kMaxNonce && out->abytes >= 16 && out->abytes <= kMaxTag;
}

Sodium Load() {
  Sodium s;
  const char* fix =
      ": pyzmq's wheel ships it (pyzmq.libs/libsodium-*.so) and bps_tf loads it with libzmq. "
      "Install pyzmq from its wheel, or the system's libsodium (libsodium23 or newer), or set "
      "BYTEPS_ENCRYPTION=curve (ZeroMQ CURVE, slower) on every node";
  FindLoadedSodium(&s.api);
  if (!s.api.complete()) {
    s.missing = std::string("BYTEPS_ENCRYPTION=1 needs libsodium, and none is loaded") + fix;
    return s;
  }
  if (s.api.init() < 0) {
    s.missing = "libsodium failed to initialize (sodium_init in " + s.api.path + ")";
    return s;
  }
  s.aes = s.api.runtime_has_aesni && s.api.runtime_has_aesni();
  SuiteOps aegis128l{}, aegis{}, gcm{}, xchacha{};
  bool have_aegis128l = Usable(s.api.aegis128l, Suite::kAegis128L, &aegis128l);
  bool have_aegis = Usable(s.api.aegis256, Suite::kAegis256, &aegis);
  bool have_gcm = s.api.aes256gcm.is_available && Usable(s.api.aes256gcm, Suite::kAes256Gcm, &gcm);
  bool have_xchacha = Usable(s.api.xchacha20poly1305, Suite::kXChaCha20Poly1305, &xchacha);
  // Without AES instructions libsodium's AEGIS runs a portable AES, slower
  // than XChaCha20-Poly1305's plain arithmetic.
  if (s.aes && have_aegis128l) s.suites.push_back(aegis128l);
  if (s.aes && have_aegis) s.suites.push_back(aegis);
  if (have_gcm) s.suites.push_back(gcm);
  if (have_xchacha) s.suites.push_back(xchacha);
  if (!s.aes && have_aegis128l) s.suites.push_back(aegis128l);
  if (!s.aes && have_aegis) s.suites.push_back(aegis);
  if (s.suites.empty()) {
    s.missing = "the libsodium loaded (" + s.api.path + ", " + s.api.version_string() +
                ") has none of AEGIS-128L, AEGIS-256, AES-256-GCM, XChaCha20-Poly1305" + fix;
  }
  return s;
}

}  // namespace

const Sodium& Lib() {
  static const Sodium lib = Load();
  return lib;
}

const SuiteOps* OpsOf(uint8_t suite) {
  for (const SuiteOps& s : Lib().suites) {
    if (static_cast<uint8_t>(s.id) == suite) return &s;
  }
  return nullptr;
}

uint16_t OfferedSuites() {
  uint16_t mask = 0;
  for (const SuiteOps& s : Lib().suites) mask |= static_cast<uint16_t>(1u << static_cast<int>(s.id));
  return mask;
}

void Wipe(void* p, size_t n) {
  if (Lib().api.memzero) {
    Lib().api.memzero(p, n);
  } else {
    volatile unsigned char* v = static_cast<volatile unsigned char*>(p);
    while (n--) *v++ = 0;
  }
}

const char* SuiteName(Suite s) {
  switch (s) {
    case Suite::kAegis128L: return "AEGIS-128L";
    case Suite::kAegis256: return "AEGIS-256";
    case Suite::kAes256Gcm: return "AES-256-GCM";
    case Suite::kXChaCha20Poly1305: return "XChaCha20-Poly1305";
  }
  return "?";
}

std::string SodiumMissing() { return Lib().missing; }

std::string SodiumDescribe() {
  const Sodium& s = Lib();
  if (!s.missing.empty()) return s.missing;
  return std::string("libsodium ") + s.api.version_string() + " (" + s.api.path + "), " +
         SuiteName(s.suites[0].id) + " preferred" +
         (s.aes ? " (AES instructions)" : " (no AES instructions)");
}

}  // namespace bps
