// The sum engine's compressed keys: a compressed push is checked against
// the key's first description, decompressed into the float32 sum, and the
// round's sum compressed again (with the server's own error feedback) for
// the replies.
#include "server/sum_engine.h"

#include <cstring>

#include "common/common.h"
#include "math/reduce.h"

namespace bps {

std::string SumEngine::CheckCompressed(KeyState& st, const PushJob& job) {
  if (!job.compressed || !st.compressed) {
    return std::string("pushed a partition ") + (job.compressed ? "compressed" : "uncompressed") +
           " that other workers push " + (st.compressed ? "compressed" : "uncompressed") +
           " (every worker must use the same compression)";
  }
  if (job.dtype != BPS_FLOAT32) return "pushed a compressed partition that is not float32";
  if (job.payload.size() < sizeof(CompressedHeader)) return "pushed a truncated compressed partition";
  CompressedHeader h;
  std::memcpy(&h, job.payload.data(), sizeof(h));
  CompressorSpec spec;
  try {
    spec = SpecFromHeader(h);
  } catch (const std::exception& e) {
    return std::string("pushed a malformed compressed partition: ") + e.what();
  }
  if (st.described.kind == 0) {
    if (job.payload.size() != CompressedBytes(spec, h.count)) {
      return "pushed a compressed partition whose size does not match its description";
    }
    st.described = h;
    st.spec = spec;
    st.acc.assign(h.count, 0.0f);
    return "";
  }
  if (std::memcmp(&h, &st.described, sizeof(h)) != 0 || job.payload.size() != st.bytes) {
    return "compresses this partition as '" + spec.Text() + "' of " + std::to_string(h.count) +
           " elements, another worker as '" + st.spec.Text() + "' of " +
           std::to_string(st.described.count) + " (every worker must use the same compression)";
  }
  return "";
}

void SumEngine::AddCompressed(KeyState& st, const PushJob& job) {
  size_t n = st.described.count;
  if (!st.has_sum) {
    Decompress(st.spec, job.payload.data(), job.payload.size(), n, st.acc.data());
    st.has_sum = true;
    return;
  }
  st.scratch.resize(n);
  Decompress(st.spec, job.payload.data(), job.payload.size(), n, st.scratch.data());
  SumInto(BPS_FLOAT32, st.acc.data(), st.scratch.data(), n);
}

Msg SumEngine::CompressSum(KeyState& st, uint64_t key) {
  size_t n = st.described.count;
  Msg out(CompressedBytes(st.spec, n));
  // randomk draws the workers' stream, so the sum keeps its indices.
  uint64_t who = st.spec.kind == CompressorKind::kRandomK
                     ? kSharedStream
                     : (1ULL << 32) | static_cast<uint64_t>(server_id_);
  st.state.Encode(st.spec, st.acc.data(), n, 0, n, StreamSeed(st.spec.seed, key, st.round, who),
                  /*use_momentum=*/false, out.data());
  return out;
}

}  // namespace bps
