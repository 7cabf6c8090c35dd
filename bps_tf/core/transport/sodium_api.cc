#include "transport/sodium_api.h"

#include <dlfcn.h>
#include <link.h>

#include <vector>

namespace bps {

namespace {

int CollectSodium(struct dl_phdr_info* info, size_t, void* data) {
  std::string name = info->dlpi_name ? info->dlpi_name : "";
  size_t slash = name.rfind('/');
  if (name.find("libsodium", slash == std::string::npos ? 0 : slash) != std::string::npos) {
    static_cast<std::vector<std::string>*>(data)->push_back(name);
  }
  return 0;
}

template <typename F>
void Find(void* handle, const char* name, F** out) {
  *out = reinterpret_cast<F*>(dlsym(handle, name));
}

void FindAead(void* handle, const std::string& prefix, SodiumAead* a) {
  Find(handle, (prefix + "_encrypt_detached").c_str(), &a->encrypt);
  Find(handle, (prefix + "_decrypt_detached").c_str(), &a->decrypt);
  Find(handle, (prefix + "_keybytes").c_str(), &a->keybytes);
  Find(handle, (prefix + "_npubbytes").c_str(), &a->npubbytes);
  Find(handle, (prefix + "_abytes").c_str(), &a->abytes);
  Find(handle, (prefix + "_is_available").c_str(), &a->is_available);
}

}  // namespace

bool SodiumApi::complete() const {
  return init && version_string && memzero && randombytes_buf && verify_32 && generichash &&
         kx_keypair && kx_client_session_keys && kx_server_session_keys;
}

void FindLoadedSodium(SodiumApi* api) {
  std::vector<std::string> loaded;
  dl_iterate_phdr(&CollectSodium, &loaded);
  for (const std::string& path : loaded) {
    // Already loaded: this only takes a handle (never released: the
    // library stays for the life of the process anyway).
    void* handle = dlopen(path.c_str(), RTLD_LAZY | RTLD_NOLOAD);
    if (!handle) continue;
    SodiumApi a;
    a.path = path;
    Find(handle, "sodium_init", &a.init);
    Find(handle, "sodium_version_string", &a.version_string);
    Find(handle, "sodium_runtime_has_aesni", &a.runtime_has_aesni);
    Find(handle, "sodium_memzero", &a.memzero);
    Find(handle, "randombytes_buf", &a.randombytes_buf);
    Find(handle, "crypto_verify_32", &a.verify_32);
    Find(handle, "crypto_generichash", &a.generichash);
    Find(handle, "crypto_kx_keypair", &a.kx_keypair);
    Find(handle, "crypto_kx_client_session_keys", &a.kx_client_session_keys);
    Find(handle, "crypto_kx_server_session_keys", &a.kx_server_session_keys);
    FindAead(handle, "crypto_aead_aegis128l", &a.aegis128l);
    FindAead(handle, "crypto_aead_aegis256", &a.aegis256);
    FindAead(handle, "crypto_aead_aes256gcm", &a.aes256gcm);
    FindAead(handle, "crypto_aead_xchacha20poly1305_ietf", &a.xchacha20poly1305);
    if (a.complete()) {
      *api = a;
      return;
    }
  }
}

}  // namespace bps
