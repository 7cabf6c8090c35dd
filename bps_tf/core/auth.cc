#include "auth.h"

#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

namespace bps {

namespace {

// SHA-256's constants are the first 32 bits of the fractional parts of the
// square roots (initial hash) and cube roots (round constants) of the first
// primes; computing them avoids a hand-typed table.
struct Sha256Constants {
  uint32_t h0[8];
  uint32_t k[64];
  Sha256Constants() {
    std::vector<int> primes;
    for (int n = 2; primes.size() < 64; ++n) {
      bool prime = true;
      for (int p : primes) {
        if (p * p > n) break;
        if (n % p == 0) {
          prime = false;
          break;
        }
      }
      if (prime) primes.push_back(n);
    }
    for (int i = 0; i < 8; ++i) h0[i] = Frac32(std::sqrt(static_cast<long double>(primes[i])));
    for (int i = 0; i < 64; ++i) k[i] = Frac32(std::cbrt(static_cast<long double>(primes[i])));
  }
  static uint32_t Frac32(long double x) {
    long double frac = x - std::floor(x);
    return static_cast<uint32_t>(std::floor(frac * 4294967296.0L));
  }
};

const Sha256Constants& Constants() {
  static const Sha256Constants c;
  return c;
}

inline uint32_t Rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

void Compress(uint32_t state[8], const uint8_t block[64]) {
  const uint32_t* k = Constants().k;
  uint32_t w[64];
  for (int i = 0; i < 16; ++i) {
    w[i] = (uint32_t(block[4 * i]) << 24) | (uint32_t(block[4 * i + 1]) << 16) |
           (uint32_t(block[4 * i + 2]) << 8) | uint32_t(block[4 * i + 3]);
  }
  for (int i = 16; i < 64; ++i) {
    uint32_t s0 = Rotr(w[i - 15], 7) ^ Rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = Rotr(w[i - 2], 17) ^ Rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
  uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
  for (int i = 0; i < 64; ++i) {
    uint32_t t1 = h + (Rotr(e, 6) ^ Rotr(e, 11) ^ Rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
    uint32_t t2 = (Rotr(a, 2) ^ Rotr(a, 13) ^ Rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  state[0] += a;
  state[1] += b;
  state[2] += c;
  state[3] += d;
  state[4] += e;
  state[5] += f;
  state[6] += g;
  state[7] += h;
}

std::mutex g_token_mu;
std::string g_token;
bool g_auth = false;

}  // namespace

void Sha256(const void* data, size_t len, uint8_t out[32]) {
  uint32_t state[8];
  std::memcpy(state, Constants().h0, sizeof(state));
  const uint8_t* p = static_cast<const uint8_t*>(data);
  size_t full = len / 64;
  for (size_t i = 0; i < full; ++i) Compress(state, p + 64 * i);
  uint8_t tail[128] = {0};
  size_t rest = len - full * 64;
  std::memcpy(tail, p + full * 64, rest);
  tail[rest] = 0x80;
  size_t tail_len = rest + 9 <= 64 ? 64 : 128;
  uint64_t bits = static_cast<uint64_t>(len) * 8;
  for (int i = 0; i < 8; ++i) tail[tail_len - 1 - i] = static_cast<uint8_t>(bits >> (8 * i));
  Compress(state, tail);
  if (tail_len == 128) Compress(state, tail + 64);
  for (int i = 0; i < 8; ++i) {
    out[4 * i] = static_cast<uint8_t>(state[i] >> 24);
    out[4 * i + 1] = static_cast<uint8_t>(state[i] >> 16);
    out[4 * i + 2] = static_cast<uint8_t>(state[i] >> 8);
    out[4 * i + 3] = static_cast<uint8_t>(state[i]);
  }
}

void HmacSha256(const std::string& key, const void* data, size_t len, uint8_t out[32]) {
  uint8_t k[64] = {0};
  if (key.size() > 64) {
    Sha256(key.data(), key.size(), k);
  } else {
    std::memcpy(k, key.data(), key.size());
  }
  std::vector<uint8_t> inner(64 + len);
  for (int i = 0; i < 64; ++i) inner[i] = k[i] ^ 0x36;
  if (len) std::memcpy(inner.data() + 64, data, len);
  uint8_t inner_hash[32];
  Sha256(inner.data(), inner.size(), inner_hash);
  uint8_t outer[96];
  for (int i = 0; i < 64; ++i) outer[i] = k[i] ^ 0x5c;
  std::memcpy(outer + 64, inner_hash, 32);
  Sha256(outer, sizeof(outer), out);
}

void SetJobToken(const std::string& token) {
  std::lock_guard<std::mutex> lock(g_token_mu);
  g_token = token;
  g_auth = !token.empty();
}

bool AuthEnabled() {
  std::lock_guard<std::mutex> lock(g_token_mu);
  return g_auth;
}

namespace {
constexpr size_t kMacOffset = 48;  // FrameHeader::reserved
constexpr size_t kMacLen = 16;

void Mac(const void* header64, uint8_t out[kMacLen]) {
  uint8_t copy[64];
  std::memcpy(copy, header64, 64);
  std::memset(copy + kMacOffset, 0, kMacLen);
  std::string token;
  {
    std::lock_guard<std::mutex> lock(g_token_mu);
    token = g_token;
  }
  uint8_t full[32];
  HmacSha256(token, copy, sizeof(copy), full);
  std::memcpy(out, full, kMacLen);
}
}  // namespace

void SealHeader(void* header64) {
  uint8_t* h = static_cast<uint8_t*>(header64);
  if (!AuthEnabled()) {
    std::memset(h + kMacOffset, 0, kMacLen);
    return;
  }
  Mac(header64, h + kMacOffset);
}

bool HeaderAuthentic(const void* header64) {
  if (!AuthEnabled()) return true;
  uint8_t expect[kMacLen];
  Mac(header64, expect);
  const uint8_t* got = static_cast<const uint8_t*>(header64) + kMacOffset;
  uint8_t diff = 0;  // constant time: no early exit on the first wrong byte
  for (size_t i = 0; i < kMacLen; ++i) diff |= expect[i] ^ got[i];
  return diff == 0;
}

}  // namespace bps
