#include "math/compressor.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "common/common.h"

namespace bps {

namespace {

const char* KindName(CompressorKind kind) {
  switch (kind) {
    case CompressorKind::kNone: return "none";
    case CompressorKind::kOneBit: return "onebit";
    case CompressorKind::kTopK: return "topk";
    case CompressorKind::kRandomK: return "randomk";
    case CompressorKind::kDithering: return "dithering";
  }
  return "?";
}

// The shortest text that reads back as v (Python's repr of it too).
std::string Num(double v) {
  char buf[40];
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof(buf), "%.*g", digits, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

double ParseDouble(const std::string& key, const std::string& text) {
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(v)) {
    throw Error("compression: " + key + "=" + text + " is not a number");
  }
  return v;
}

// Magnitude used to rank topk candidates; NaN ranks first so it is not lost.
inline float Magnitude(float v) { return std::isnan(v) ? INFINITY : std::fabs(v); }

void WriteSparse(const float* x, const std::vector<uint32_t>& idx, char* out) {
  size_t k = idx.size();
  std::memcpy(out, idx.data(), k * sizeof(uint32_t));
  float* values = reinterpret_cast<float*>(out + k * sizeof(uint32_t));
  for (size_t i = 0; i < k; ++i) values[i] = x[idx[i]];
}

}  // namespace

CompressorSpec CompressorSpec::Parse(const std::string& text) {
  CompressorSpec spec;
  if (text.empty()) return spec;  // the uncompressed path: no parsing
  std::istringstream in(text);
  std::string kind;
  if (!(in >> kind) || kind == "none") return spec;
  if (kind == "onebit") spec.kind = CompressorKind::kOneBit;
  else if (kind == "topk") spec.kind = CompressorKind::kTopK;
  else if (kind == "randomk") spec.kind = CompressorKind::kRandomK;
  else if (kind == "dithering") spec.kind = CompressorKind::kDithering;
  else throw Error("compression: unknown compressor '" + kind +
                   "' (known: none, onebit, topk, randomk, dithering)");
  bool sparse = spec.kind == CompressorKind::kTopK || spec.kind == CompressorKind::kRandomK;
  bool seeded = spec.kind == CompressorKind::kRandomK || spec.kind == CompressorKind::kDithering;
  bool has_ratio = false, has_levels = false;
  std::string item;
  while (in >> item) {
    size_t eq = item.find('=');
    std::string key = item.substr(0, eq);
    std::string val = eq == std::string::npos ? "" : item.substr(eq + 1);
    if (key == "ef") {
      spec.error_feedback = ParseDouble(key, val) != 0;
    } else if (key == "momentum") {
      spec.momentum = ParseDouble(key, val);
      if (spec.momentum < 0 || spec.momentum >= 1) {
        throw Error("compression: momentum=" + val + " must be in [0, 1)");
      }
    } else if (key == "scaling" && spec.kind == CompressorKind::kOneBit) {
      spec.scaling = ParseDouble(key, val) != 0;
    } else if (key == "ratio" && sparse) {
      spec.ratio = ParseDouble(key, val);
      has_ratio = true;
      if (!(spec.ratio > 0 && spec.ratio <= 1)) {
        throw Error("compression: " + kind + " ratio=" + val + " must be in (0, 1]");
      }
    } else if (key == "levels" && spec.kind == CompressorKind::kDithering) {
      double levels = ParseDouble(key, val);
      if (levels != std::floor(levels) || levels < 1 || levels > 127) {
        throw Error("compression: dithering levels=" + val + " must be an integer in [1, 127]");
      }
      spec.levels = static_cast<int>(levels);
      has_levels = true;
    } else if (key == "seed" && seeded) {
      char* end = nullptr;
      spec.seed = std::strtoull(val.c_str(), &end, 10);
      if (val.empty() || *end != '\0' || val[0] == '-') {
        throw Error("compression: seed=" + val + " is not a non-negative integer");
      }
    } else {
      throw Error("compression: " + kind + " takes no parameter '" + item + "'");
    }
  }
  if (sparse && !has_ratio) throw Error("compression: " + kind + " needs ratio=");
  if (spec.kind == CompressorKind::kDithering && !has_levels) {
    throw Error("compression: dithering needs levels=");
  }
  return spec;
}

std::string CompressorSpec::Text() const {
  if (kind == CompressorKind::kNone) return "";
  std::string t = KindName(kind);
  if (kind == CompressorKind::kOneBit) t += std::string(" scaling=") + (scaling ? "1" : "0");
  if (kind == CompressorKind::kTopK || kind == CompressorKind::kRandomK) t += " ratio=" + Num(ratio);
  if (kind == CompressorKind::kDithering) t += " levels=" + std::to_string(levels);
  if (kind == CompressorKind::kRandomK || kind == CompressorKind::kDithering) {
    t += " seed=" + std::to_string(seed);
  }
  t += std::string(" ef=") + (error_feedback ? "1" : "0");
  t += " momentum=" + Num(momentum);
  return t;
}

CompressedHeader MakeCompressedHeader(const CompressorSpec& spec, uint32_t count) {
  CompressedHeader h;
  std::memset(&h, 0, sizeof(h));
  h.kind = static_cast<uint8_t>(spec.kind);
  h.flags = static_cast<uint8_t>((spec.scaling ? 1 : 0) | (spec.error_feedback ? 2 : 0));
  h.levels = static_cast<uint16_t>(spec.levels);
  h.count = count;
  h.ratio = spec.ratio;
  h.seed = spec.seed;
  return h;
}

CompressorSpec SpecFromHeader(const CompressedHeader& h) {
  CompressorSpec spec;
  if (h.kind < 1 || h.kind > 4 || (h.flags & ~3u) != 0) {
    throw Error("compressed partition with an unknown compressor " + std::to_string(h.kind));
  }
  spec.kind = static_cast<CompressorKind>(h.kind);
  spec.scaling = (h.flags & 1) != 0;
  spec.error_feedback = (h.flags & 2) != 0;
  spec.levels = h.levels;
  spec.ratio = h.ratio;
  spec.seed = h.seed;
  bool sparse = spec.kind == CompressorKind::kTopK || spec.kind == CompressorKind::kRandomK;
  if (sparse && !(spec.ratio > 0 && spec.ratio <= 1)) throw Error("compressed partition: bad ratio");
  if (spec.kind == CompressorKind::kDithering && (spec.levels < 1 || spec.levels > 127)) {
    throw Error("compressed partition: bad dithering levels");
  }
  return spec;
}

size_t SparseCount(double ratio, size_t n) {
  if (n == 0) return 0;
  double k = std::ceil(ratio * static_cast<double>(n));
  return std::min(n, std::max<size_t>(1, static_cast<size_t>(k)));
}

size_t CompressedBytes(const CompressorSpec& spec, size_t n) {
  size_t body = 0;
  switch (spec.kind) {
    case CompressorKind::kNone: return n * sizeof(float);
    case CompressorKind::kOneBit: body = sizeof(float) + (n + 7) / 8; break;
    case CompressorKind::kTopK:
    case CompressorKind::kRandomK: body = SparseCount(spec.ratio, n) * 8; break;
    case CompressorKind::kDithering: body = sizeof(float) + n; break;
  }
  return sizeof(CompressedHeader) + body;
}

uint64_t SplitMix64::Next() {
  uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

float SplitMix64::Uniform() { return static_cast<float>(Next() >> 40) * (1.0f / 16777216.0f); }

uint64_t StreamSeed(uint64_t seed, uint64_t key, uint64_t round, uint64_t who) {
  SplitMix64 s{seed};
  s.state = s.Next() ^ key;
  s.state = s.Next() ^ round;
  s.state = s.Next() ^ who;
  return s.Next();
}

namespace {
void CompressOneBit(const CompressorSpec& spec, const float* x, size_t n, char* body) {
  float scale = 1.0f;
  if (spec.scaling) {
    double sum = 0;
    for (size_t i = 0; i < n; ++i) sum += std::fabs(static_cast<double>(x[i]));
    scale = n ? static_cast<float>(sum / static_cast<double>(n)) : 0.0f;
  }
  std::memcpy(body, &scale, sizeof(scale));
  uint8_t* bits = reinterpret_cast<uint8_t*>(body + sizeof(scale));
  std::memset(bits, 0, (n + 7) / 8);
  for (size_t i = 0; i < n; ++i) {
    if (x[i] < 0) bits[i / 8] = static_cast<uint8_t>(bits[i / 8] | (1u << (i % 8)));
  }
}

void CompressTopK(const CompressorSpec& spec, const float* x, size_t n, char* body) {
  size_t k = SparseCount(spec.ratio, n);
  std::vector<uint32_t> idx(n);
  for (size_t i = 0; i < n; ++i) idx[i] = static_cast<uint32_t>(i);
  // Largest magnitude first; equal magnitudes by lower index, so the
  // choice is deterministic.
  auto before = [x](uint32_t a, uint32_t b) {
    float ma = Magnitude(x[a]), mb = Magnitude(x[b]);
    return ma != mb ? ma > mb : a < b;
  };
  if (k < n) std::nth_element(idx.begin(), idx.begin() + static_cast<long>(k), idx.end(), before);
  idx.resize(k);
  std::sort(idx.begin(), idx.end());
  WriteSparse(x, idx, body);
}

void CompressRandomK(const CompressorSpec& spec, const float* x, size_t n, uint64_t stream,
                     char* body) {
  size_t k = SparseCount(spec.ratio, n);
  std::vector<uint32_t> perm(n);
  for (size_t i = 0; i < n; ++i) perm[i] = static_cast<uint32_t>(i);
  SplitMix64 rng{stream};
  for (size_t i = 0; i < k; ++i) {
    size_t j = i + static_cast<size_t>(rng.Next() % (n - i));
    std::swap(perm[i], perm[j]);
  }
  perm.resize(k);
  std::sort(perm.begin(), perm.end());
  WriteSparse(x, perm, body);
}

void CompressDithering(const CompressorSpec& spec, const float* x, size_t n, uint64_t stream,
                       char* body) {
  float scale = 0.0f;
  bool finite = true;
  for (size_t i = 0; i < n; ++i) {
    scale = std::fmax(scale, std::fabs(x[i]));
    finite = finite && std::isfinite(x[i]);
  }
  // A nan or inf makes the whole partition nan: visible, not rounded away.
  if (!finite) scale = NAN;
  std::memcpy(body, &scale, sizeof(scale));
  int8_t* q = reinterpret_cast<int8_t*>(body + sizeof(scale));
  const float levels = static_cast<float>(spec.levels);
  SplitMix64 rng{stream};
  for (size_t i = 0; i < n; ++i) {
    if (!(scale > 0) || !std::isfinite(scale)) {
      q[i] = 0;
      continue;
    }
    float a = std::fabs(x[i]) / scale;
    float b = a * levels;
    float c = b + rng.Uniform();  // stochastic rounding: unbiased
    int level = c >= 0 ? static_cast<int>(std::floor(c)) : 0;
    level = std::min(level, spec.levels);
    q[i] = static_cast<int8_t>(x[i] < 0 ? -level : level);
  }
}
}  // namespace

void Compress(const CompressorSpec& spec, const float* x, size_t n, uint64_t stream, char* out) {
  if (n > UINT32_MAX) throw Error("compression: a partition holds more than 2^32 elements");
  if (spec.kind == CompressorKind::kNone) {
    std::memcpy(out, x, n * sizeof(float));  // no header: the raw partition
    return;
  }
  CompressedHeader h = MakeCompressedHeader(spec, static_cast<uint32_t>(n));
  std::memcpy(out, &h, sizeof(h));
  char* body = out + sizeof(h);
  switch (spec.kind) {
    case CompressorKind::kNone:
      return;
    case CompressorKind::kOneBit:
      return CompressOneBit(spec, x, n, body);
    case CompressorKind::kTopK:
      return CompressTopK(spec, x, n, body);
    case CompressorKind::kRandomK:
      return CompressRandomK(spec, x, n, stream, body);
    case CompressorKind::kDithering:
      return CompressDithering(spec, x, n, stream, body);
  }
}

void Decompress(const CompressorSpec& spec, const char* in, size_t in_bytes, size_t n, float* out) {
  if (in_bytes != CompressedBytes(spec, n)) {
    throw Error("compressed partition of " + std::to_string(in_bytes) + " bytes; " +
                spec.Text() + " of " + std::to_string(n) + " elements takes " +
                std::to_string(CompressedBytes(spec, n)));
  }
  if (spec.kind == CompressorKind::kNone) {
    std::memcpy(out, in, n * sizeof(float));
    return;
  }
  CompressedHeader h;
  std::memcpy(&h, in, sizeof(h));
  if (h.count != n || h.kind != static_cast<uint8_t>(spec.kind)) {
    throw Error("compressed partition describes " + std::to_string(h.count) +
                " elements of compressor " + std::to_string(h.kind) + ", expected " +
                std::to_string(n) + " of " + spec.Text());
  }
  const char* body = in + sizeof(h);
  switch (spec.kind) {
    case CompressorKind::kNone:
      return;
    case CompressorKind::kOneBit: {
      float scale;
      std::memcpy(&scale, body, sizeof(scale));
      const uint8_t* bits = reinterpret_cast<const uint8_t*>(body + sizeof(scale));
      for (size_t i = 0; i < n; ++i) out[i] = (bits[i / 8] >> (i % 8)) & 1 ? -scale : scale;
      return;
    }
    case CompressorKind::kTopK:
    case CompressorKind::kRandomK: {
      size_t k = SparseCount(spec.ratio, n);
      std::vector<uint32_t> idx(k);
      std::vector<float> values(k);
      std::memcpy(idx.data(), body, k * sizeof(uint32_t));
      std::memcpy(values.data(), body + k * sizeof(uint32_t), k * sizeof(float));
      std::fill(out, out + n, 0.0f);
      for (size_t i = 0; i < k; ++i) {
        if (idx[i] >= n || (i > 0 && idx[i] <= idx[i - 1])) {
          throw Error("compressed partition: sparse indices out of range or out of order");
        }
        out[idx[i]] = values[i];
      }
      return;
    }
    case CompressorKind::kDithering: {
      float scale;
      std::memcpy(&scale, body, sizeof(scale));
      const int8_t* q = reinterpret_cast<const int8_t*>(body + sizeof(scale));
      const float levels = static_cast<float>(spec.levels);
      for (size_t i = 0; i < n; ++i) out[i] = (static_cast<float>(q[i]) * scale) / levels;
      return;
    }
  }
}

void CompressorState::Encode(const CompressorSpec& spec, const float* g, size_t n, size_t offset,
                             size_t total, uint64_t stream, bool use_momentum, char* out) {
  bool momentum = use_momentum && spec.momentum > 0;
  if (!momentum && !spec.error_feedback) {
    Compress(spec, g, n, stream, out);
    return;
  }
  if (offset + n > total) throw Error("compression: partition outside its tensor");
  work_.assign(g, g + n);
  if (momentum) {
    if (momentum_.size() != total) momentum_.assign(total, 0.0f);
    const float mu = static_cast<float>(spec.momentum);
    float* m = momentum_.data() + offset;
    for (size_t i = 0; i < n; ++i) {
      m[i] = mu * m[i] + g[i];
      work_[i] = g[i] + mu * m[i];
    }
  }
  if (spec.error_feedback) {
    if (residual_.size() != total) residual_.assign(total, 0.0f);
    float* r = residual_.data() + offset;
    for (size_t i = 0; i < n; ++i) work_[i] += r[i];
    Compress(spec, work_.data(), n, stream, out);
    std::vector<float> sent(n);
    Decompress(spec, out, CompressedBytes(spec, n), n, sent.data());
    for (size_t i = 0; i < n; ++i) r[i] = work_[i] - sent[i];
    return;
  }
  Compress(spec, work_.data(), n, stream, out);
}

}  // namespace bps
