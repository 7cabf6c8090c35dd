#include "transport/fusion.h"

#include <cstring>

namespace bps {

void FusedBuilder::Add(const FusedPart& part, const void* data) {
  parts_.push_back(part);
  data_.push_back(data);
  bytes_ += FusedCost(part.payload_bytes);
}

char* FusedBuilder::Finish(uint64_t* size) {
  char* buf = new char[bytes_];
  uint32_t prefix[2] = {static_cast<uint32_t>(parts_.size()), 0};
  std::memcpy(buf, prefix, sizeof(prefix));
  char* head = buf + kFusedPrefixBytes;
  char* body = head + parts_.size() * sizeof(FusedPart);
  for (size_t i = 0; i < parts_.size(); ++i) {
    std::memcpy(head + i * sizeof(FusedPart), &parts_[i], sizeof(FusedPart));
    uint64_t n = parts_[i].payload_bytes;
    if (n) std::memcpy(body, data_[i], n);
    // Padding is zeroed so no stale heap bytes leave the process.
    std::memset(body + n, 0, FusedAlign(n) - n);
    body += FusedAlign(n);
  }
  *size = bytes_;
  parts_.clear();
  data_.clear();
  bytes_ = kFusedPrefixBytes;
  return buf;
}

std::string ParseFused(const char* payload, uint64_t size, std::vector<FusedView>* out) {
  out->clear();
  if (size < kFusedPrefixBytes) return "fused message shorter than its prefix";
  uint32_t prefix[2];
  std::memcpy(prefix, payload, sizeof(prefix));
  uint64_t count = prefix[0];
  if (count == 0 || prefix[1] != 0) return "fused message with a bad prefix";
  uint64_t heads = count * sizeof(FusedPart);
  if (heads > size - kFusedPrefixBytes) return "fused message shorter than its sub-headers";
  uint64_t offset = kFusedPrefixBytes + heads;
  out->reserve(count);
  for (uint64_t i = 0; i < count; ++i) {
    FusedView v;
    std::memcpy(&v.part, payload + kFusedPrefixBytes + i * sizeof(FusedPart), sizeof(FusedPart));
    for (uint8_t b : v.part.reserved) {
      if (b != 0) {
        out->clear();
        return "fused sub-header with reserved bytes not zero";
      }
    }
    uint64_t n = v.part.payload_bytes;
    if (n > size - offset || FusedAlign(n) > size - offset) {
      out->clear();
      return "fused part " + std::to_string(i) + " runs past the message";
    }
    v.data = payload + offset;
    offset += FusedAlign(n);
    out->push_back(v);
  }
  if (offset != size) {
    out->clear();
    return "fused message with " + std::to_string(size - offset) + " bytes after its parts";
  }
  return "";
}

}  // namespace bps
