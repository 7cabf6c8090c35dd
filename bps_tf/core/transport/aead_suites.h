// The AEADs of sealed links (link_cipher.h) that this process runs, taken
// from the libsodium it has loaded (sodium_api.h), in the order it prefers
// them, and the other libsodium functions the links use.
#ifndef BPS_TF_CORE_TRANSPORT_AEAD_SUITES_H_
#define BPS_TF_CORE_TRANSPORT_AEAD_SUITES_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "transport/link_cipher.h"
#include "transport/sodium_api.h"

namespace bps {

constexpr size_t kMaxNonce = 32, kMaxTag = 32;

struct SuiteOps {
  Suite id;
  bps_aead_encrypt_fn* encrypt;
  bps_aead_decrypt_fn* decrypt;
  size_t key, npub, abytes;
};

struct Sodium {
  SodiumApi api;
  std::string missing;           // empty when usable
  std::vector<SuiteOps> suites;  // what this process runs, preferred first
  bool aes = false;              // the CPU has AES instructions
};

// Loaded once, on first use.
const Sodium& Lib();
// The suite's functions and sizes; null for one this process does not run.
const SuiteOps* OpsOf(uint8_t suite);
// Bit (1 << suite) for each suite this process runs.
uint16_t OfferedSuites();
// sodium_memzero: a wipe the compiler cannot drop.
void Wipe(void* p, size_t n);

}  // namespace bps

#endif  // BPS_TF_CORE_TRANSPORT_AEAD_SUITES_H_
