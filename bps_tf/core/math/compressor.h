// Gradient compressors of float32 partitions: onebit, topk, randomk and
// dithering, with optional error feedback and momentum correction.
//
// A compressed partition is self-describing: it starts with a 24-byte
// CompressedHeader naming the compressor, its parameters and the element
// count, so a server can decompress, sum and re-compress without any other
// message telling it how (see docs/compression.md for the layout).
#ifndef BPS_TF_CORE_MATH_COMPRESSOR_H_
#define BPS_TF_CORE_MATH_COMPRESSOR_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace bps {

enum class CompressorKind : uint8_t { kNone = 0, kOneBit = 1, kTopK = 2, kRandomK = 3, kDithering = 4 };

// What the user chose, parsed from text such as "topk ratio=0.01 ef=1".
struct CompressorSpec {
  CompressorKind kind = CompressorKind::kNone;
  bool scaling = true;        // onebit: scale the signs by mean |x| (else 1)
  double ratio = 0;           // topk/randomk: k = ceil(ratio * n), at least 1
  int levels = 0;             // dithering: 1..127 quantisation levels
  uint64_t seed = 0;          // randomk/dithering: the random stream's seed
  bool error_feedback = false;
  double momentum = 0;        // 0: none; else Nesterov-style local momentum

  // Throws bps::Error naming the bad part. Empty text or "none": kNone.
  static CompressorSpec Parse(const std::string& text);
  // Canonical text (parses back to the same spec); "" for kNone.
  std::string Text() const;
  bool active() const { return kind != CompressorKind::kNone; }
};

#pragma pack(push, 1)
struct CompressedHeader {
  uint8_t kind;      // CompressorKind
  uint8_t flags;     // bit 0: scaling, bit 1: error feedback
  uint16_t levels;
  uint32_t count;    // elements of the uncompressed partition
  double ratio;
  uint64_t seed;
};
#pragma pack(pop)
static_assert(sizeof(CompressedHeader) == 24, "CompressedHeader is 24 bytes on the wire");

CompressedHeader MakeCompressedHeader(const CompressorSpec& spec, uint32_t count);
// The spec a header describes (momentum is the worker's alone: 0 here).
// Throws bps::Error when the header is malformed.
CompressorSpec SpecFromHeader(const CompressedHeader& h);

// k of topk/randomk for n elements.
size_t SparseCount(double ratio, size_t n);
// Bytes of a compressed partition of n elements, header included.
size_t CompressedBytes(const CompressorSpec& spec, size_t n);

// The random stream of one compression; the same inputs give the same stream
// on every node. `who` separates workers (dithering) or is kSharedStream
// when every node must draw the same numbers (randomk's indices).
constexpr uint64_t kSharedStream = ~0ULL;
uint64_t StreamSeed(uint64_t seed, uint64_t key, uint64_t round, uint64_t who);

// splitmix64: small, fast and easy to reproduce in a numpy reference.
struct SplitMix64 {
  uint64_t state;
  uint64_t Next();
  float Uniform();  // [0, 1) with 24 random bits
};

// Compresses x[0..n) into out (CompressedBytes(spec, n) bytes). Stateless:
// error feedback and momentum are CompressorState's.
void Compress(const CompressorSpec& spec, const float* x, size_t n, uint64_t stream, char* out);
// Decompresses a whole compressed partition (header included) into out[0..n).
// Throws bps::Error when the bytes do not describe n elements of `spec`.
void Decompress(const CompressorSpec& spec, const char* in, size_t in_bytes, size_t n, float* out);

// Per-tensor state of one node: the error-feedback residual and the momentum.
// Sized for the whole tensor on first use; a partition works on its slice.
class CompressorState {
 public:
  // Applies momentum (worker side, when the spec asks) and error feedback to
  // g[0..n) (the slice at `offset` of a tensor of `total` elements), then
  // compresses into out.
  void Encode(const CompressorSpec& spec, const float* g, size_t n, size_t offset, size_t total,
              uint64_t stream, bool use_momentum, char* out);

 private:
  std::vector<float> residual_;
  std::vector<float> momentum_;
  std::vector<float> work_;
};

}  // namespace bps

#endif  // BPS_TF_CORE_MATH_COMPRESSOR_H_
