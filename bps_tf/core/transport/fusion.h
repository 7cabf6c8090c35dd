// Tensor fusion on the wire: several small partitions bound for one server
// (kPushFused) or one worker (kPullReplyFused) travel as one message, so the
// per-message cost (framing, a libzmq hand-over, a wake-up of the peer's
// I/O thread, encryption's boxing) is paid once for all of them.
//
// Payload: [uint32 count][uint32 zero][count x FusedPart][the parts' bytes,
// each starting at an 8-byte boundary, in the order of the sub-headers]. A
// FusedPart carries for its partition what a FrameHeader carries for a
// kPush or kPullReply (members included); the outer header's key, round, dtype, contributors
// and reduce_op are zero.
#ifndef BPS_TF_CORE_TRANSPORT_FUSION_H_
#define BPS_TF_CORE_TRANSPORT_FUSION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace bps {

#pragma pack(push, 1)
struct FusedPart {
  uint64_t key;
  uint64_t round;
  uint64_t request_id;  // as in a FrameHeader of the same type
  uint64_t payload_bytes;
  uint32_t contributors;
  uint16_t dtype;
  uint8_t reduce_op;
  uint64_t members;     // as FrameHeader::members (process sets); 0 otherwise
  uint8_t reserved[1];  // zero
};
#pragma pack(pop)
static_assert(sizeof(FusedPart) == 48, "FusedPart is 48 bytes on the wire");

constexpr size_t kFusedPrefixBytes = 8;

inline uint64_t FusedAlign(uint64_t n) { return (n + 7) & ~uint64_t{7}; }
// What one part adds to a fused payload: its sub-header and padded bytes.
inline uint64_t FusedCost(uint64_t bytes) { return sizeof(FusedPart) + FusedAlign(bytes); }

// One part of a fused message as read: the sub-header and where its bytes
// lie (inside the message, which must outlive it).
struct FusedView {
  FusedPart part;
  const char* data;
};

// Collects parts, in the order they must be handled, and writes the payload.
class FusedBuilder {
 public:
  void Add(const FusedPart& part, const void* data);
  size_t count() const { return parts_.size(); }
  uint64_t bytes() const { return bytes_; }  // the payload's size so far
  // The payload in a buffer of new[]; *size gets its length. Empties the builder.
  char* Finish(uint64_t* size);

 private:
  std::vector<FusedPart> parts_;
  std::vector<const void*> data_;
  uint64_t bytes_ = kFusedPrefixBytes;
};

// Splits a fused payload; returns "" or why it is malformed (then *out is
// empty). Every part's bytes lie inside the payload.
std::string ParseFused(const char* payload, uint64_t size, std::vector<FusedView>* out);

}  // namespace bps

#endif  // BPS_TF_CORE_TRANSPORT_FUSION_H_
