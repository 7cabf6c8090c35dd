// The part of libsodium's C API bps_tf uses, declared here so the build needs
// no libsodium headers and links no libsodium. bps_tf/runtime/loader.py loads
// pyzmq's bundled copy (pyzmq.libs/libsodium-*.so, fallback: the system's)
// with RTLD_GLOBAL before the core, as it does libzmq.
//
// Every symbol is weak: a process without libsodium still loads the core,
// with these addresses null, and only BYTEPS_ENCRYPTION=1 needs them
// (link_cipher.cc checks them first and says what is missing). The
// signatures are libsodium's documented, stable ones (1.0.x); the sizes the
// code relies on are asked from the library at run time, not assumed.
#ifndef BPS_TF_CORE_TRANSPORT_SODIUM_API_H_
#define BPS_TF_CORE_TRANSPORT_SODIUM_API_H_

#include <stddef.h>

#define BPS_SODIUM_WEAK __attribute__((weak))

extern "C" {

int sodium_init(void) BPS_SODIUM_WEAK;
const char* sodium_version_string(void) BPS_SODIUM_WEAK;
int sodium_runtime_has_aesni(void) BPS_SODIUM_WEAK;
void sodium_memzero(void* pnt, size_t len) BPS_SODIUM_WEAK;
int crypto_verify_32(const unsigned char* x, const unsigned char* y) BPS_SODIUM_WEAK;

int crypto_generichash(unsigned char* out, size_t outlen, const unsigned char* in,
                       unsigned long long inlen, const unsigned char* key,
                       size_t keylen) BPS_SODIUM_WEAK;

int crypto_kx_keypair(unsigned char* pk, unsigned char* sk) BPS_SODIUM_WEAK;
int crypto_kx_client_session_keys(unsigned char* rx, unsigned char* tx,
                                  const unsigned char* client_pk,
                                  const unsigned char* client_sk,
                                  const unsigned char* server_pk) BPS_SODIUM_WEAK;
int crypto_kx_server_session_keys(unsigned char* rx, unsigned char* tx,
                                  const unsigned char* server_pk,
                                  const unsigned char* server_sk,
                                  const unsigned char* client_pk) BPS_SODIUM_WEAK;

// The AEADs (one signature for all): encrypt_detached(c, mac, maclen_p, m,
// mlen, ad, adlen, nsec, npub, k); decrypt_detached(m, nsec, c, clen, mac,
// ad, adlen, npub, k), which returns -1 when the tag does not verify.
typedef int(bps_aead_encrypt_fn)(unsigned char*, unsigned char*, unsigned long long*,
                                 const unsigned char*, unsigned long long, const unsigned char*,
                                 unsigned long long, const unsigned char*, const unsigned char*,
                                 const unsigned char*);
typedef int(bps_aead_decrypt_fn)(unsigned char*, unsigned char*, const unsigned char*,
                                 unsigned long long, const unsigned char*, const unsigned char*,
                                 unsigned long long, const unsigned char*, const unsigned char*);
typedef size_t(bps_sodium_size_fn)(void);

// AEGIS-128L and AEGIS-256 (libsodium >= 1.0.19).
bps_aead_encrypt_fn crypto_aead_aegis128l_encrypt_detached BPS_SODIUM_WEAK;
bps_aead_decrypt_fn crypto_aead_aegis128l_decrypt_detached BPS_SODIUM_WEAK;
bps_sodium_size_fn crypto_aead_aegis128l_keybytes BPS_SODIUM_WEAK;
bps_sodium_size_fn crypto_aead_aegis128l_npubbytes BPS_SODIUM_WEAK;
bps_sodium_size_fn crypto_aead_aegis128l_abytes BPS_SODIUM_WEAK;
bps_aead_encrypt_fn crypto_aead_aegis256_encrypt_detached BPS_SODIUM_WEAK;
bps_aead_decrypt_fn crypto_aead_aegis256_decrypt_detached BPS_SODIUM_WEAK;
bps_sodium_size_fn crypto_aead_aegis256_keybytes BPS_SODIUM_WEAK;
bps_sodium_size_fn crypto_aead_aegis256_npubbytes BPS_SODIUM_WEAK;
bps_sodium_size_fn crypto_aead_aegis256_abytes BPS_SODIUM_WEAK;
// AES-256-GCM (only on CPUs with AES-NI and CLMUL: see _is_available).
int crypto_aead_aes256gcm_is_available(void) BPS_SODIUM_WEAK;
bps_aead_encrypt_fn crypto_aead_aes256gcm_encrypt_detached BPS_SODIUM_WEAK;
bps_aead_decrypt_fn crypto_aead_aes256gcm_decrypt_detached BPS_SODIUM_WEAK;
bps_sodium_size_fn crypto_aead_aes256gcm_keybytes BPS_SODIUM_WEAK;
bps_sodium_size_fn crypto_aead_aes256gcm_npubbytes BPS_SODIUM_WEAK;
bps_sodium_size_fn crypto_aead_aes256gcm_abytes BPS_SODIUM_WEAK;
// XChaCha20-Poly1305 (every libsodium since 1.0.12; no AES needed).
bps_aead_encrypt_fn crypto_aead_xchacha20poly1305_ietf_encrypt_detached BPS_SODIUM_WEAK;
bps_aead_decrypt_fn crypto_aead_xchacha20poly1305_ietf_decrypt_detached BPS_SODIUM_WEAK;
bps_sodium_size_fn crypto_aead_xchacha20poly1305_ietf_keybytes BPS_SODIUM_WEAK;
bps_sodium_size_fn crypto_aead_xchacha20poly1305_ietf_npubbytes BPS_SODIUM_WEAK;
bps_sodium_size_fn crypto_aead_xchacha20poly1305_ietf_abytes BPS_SODIUM_WEAK;

}  // extern "C"

#undef BPS_SODIUM_WEAK

#endif  // BPS_TF_CORE_TRANSPORT_SODIUM_API_H_
