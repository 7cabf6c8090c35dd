// The part of libsodium's C API bps_tf uses, declared here so the build needs
// no libsodium headers and links no libsodium. bps_tf/runtime/loader.py loads
// pyzmq's bundled copy (pyzmq.libs/libsodium-*.so, fallback: the system's)
// before the core, as it does libzmq; only BYTEPS_ENCRYPTION=1 needs it.
//
// Each function is looked up in that library itself (dlsym on its handle),
// never by name in the whole process: a libzmq built with its bundled
// TweetNaCl exports sodium_init, crypto_verify_32 and others of the same
// names, and a process-wide lookup would take those (seen here: libsodium
// was then never initialized and ran its slowest code). The signatures are
// libsodium's documented, stable ones (1.0.x); the sizes the code relies on
// are asked from the library, not assumed.
#ifndef BPS_TF_CORE_TRANSPORT_SODIUM_API_H_
#define BPS_TF_CORE_TRANSPORT_SODIUM_API_H_

#include <stddef.h>

#include <string>

extern "C" {
// encrypt_detached(c, mac, maclen_p, m, mlen, ad, adlen, nsec, npub, k) and
// decrypt_detached(m, nsec, c, clen, mac, ad, adlen, npub, k), which returns
// -1 when the tag does not verify: one signature for every AEAD.
typedef int(bps_aead_encrypt_fn)(unsigned char*, unsigned char*, unsigned long long*,
                                 const unsigned char*, unsigned long long, const unsigned char*,
                                 unsigned long long, const unsigned char*, const unsigned char*,
                                 const unsigned char*);
typedef int(bps_aead_decrypt_fn)(unsigned char*, unsigned char*, const unsigned char*,
                                 unsigned long long, const unsigned char*, const unsigned char*,
                                 unsigned long long, const unsigned char*, const unsigned char*);
typedef size_t(bps_sodium_size_fn)(void);
typedef int(bps_sodium_int_fn)(void);
}

namespace bps {

struct SodiumAead {
  bps_aead_encrypt_fn* encrypt = nullptr;
  bps_aead_decrypt_fn* decrypt = nullptr;
  bps_sodium_size_fn* keybytes = nullptr;
  bps_sodium_size_fn* npubbytes = nullptr;
  bps_sodium_size_fn* abytes = nullptr;
  bps_sodium_int_fn* is_available = nullptr;  // AES-256-GCM only
};

struct SodiumApi {
  std::string path;  // the library the functions come from
  bps_sodium_int_fn* init = nullptr;
  const char* (*version_string)(void) = nullptr;
  bps_sodium_int_fn* runtime_has_aesni = nullptr;
  void (*memzero)(void* pnt, size_t len) = nullptr;
  void (*randombytes_buf)(void* buf, size_t size) = nullptr;
  int (*verify_32)(const unsigned char* x, const unsigned char* y) = nullptr;
  int (*generichash)(unsigned char* out, size_t outlen, const unsigned char* in,
                     unsigned long long inlen, const unsigned char* key, size_t keylen) = nullptr;
  int (*kx_keypair)(unsigned char* pk, unsigned char* sk) = nullptr;
  int (*kx_client_session_keys)(unsigned char* rx, unsigned char* tx, const unsigned char* client_pk,
                                const unsigned char* client_sk,
                                const unsigned char* server_pk) = nullptr;
  int (*kx_server_session_keys)(unsigned char* rx, unsigned char* tx, const unsigned char* server_pk,
                                const unsigned char* server_sk,
                                const unsigned char* client_pk) = nullptr;
  SodiumAead aegis128l, aegis256, aes256gcm, xchacha20poly1305;

  // Every function the handshake needs was found (the AEADs are optional).
  bool complete() const;
};

// The functions of the libsodium loaded in this process (the first one, in
// load order, that has sodium_init); *api stays empty when none is.
void FindLoadedSodium(SodiumApi* api);

}  // namespace bps

#endif  // BPS_TF_CORE_TRANSPORT_SODIUM_API_H_
