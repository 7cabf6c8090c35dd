#include "transport/protocol.h"

#include <cstring>

namespace bps {

FrameHeader MakeHeader(MsgType type, Role role, int32_t sender) {
  FrameHeader h;
  std::memset(&h, 0, sizeof(h));
  h.magic = kMagic;
  h.version = kProtocolVersion;
  h.type = static_cast<uint16_t>(type);
  h.sender = sender;
  h.sender_role = static_cast<uint16_t>(role);
  return h;
}

std::string ValidateHeader(const void* data, size_t size, size_t payload_size) {
  if (size != sizeof(FrameHeader)) {
    return "header frame of " + std::to_string(size) + " bytes (expected 64)";
  }
  FrameHeader h;
  std::memcpy(&h, data, sizeof(h));
  if (h.magic != kMagic) return "bad magic number";
  if (h.version != kProtocolVersion) {
    return "protocol version " + std::to_string(h.version) + " (this node speaks " +
           std::to_string(kProtocolVersion) + ")";
  }
  if (h.type == 0 || h.type > kMaxMsgType) return "unknown message type " + std::to_string(h.type);
  if (h.sender_role > static_cast<uint16_t>(Role::kLauncher)) return "unknown sender role";
  if (h.payload_bytes != payload_size) {
    return "header declares " + std::to_string(h.payload_bytes) + " payload bytes but " +
           std::to_string(payload_size) + " arrived";
  }
  if (h.reduce_op > kMaxReduceOp) return "unknown reduce op " + std::to_string(h.reduce_op);
  if (h.members != 0 &&
      static_cast<uint32_t>(__builtin_popcountll(h.members)) != h.contributors) {
    return "member mask names " + std::to_string(__builtin_popcountll(h.members)) +
           " ranks but the header declares " + std::to_string(h.contributors) + " contributors";
  }
  for (uint8_t b : h.reserved) {
    if (b != 0) return "reserved header bytes are not zero";
  }
  return "";
}

const char* MsgTypeName(uint16_t type) {
  static const char* kNames[] = {"?",        "HELLO",     "WELCOME",   "BARRIER",  "BARRIER_DONE",
                                 "DECLARE",  "DECLARED",  "PUSH",      "PULL_REPLY", "HEARTBEAT",
                                 "HEARTBEAT_ACK", "BYE",  "SHUTDOWN",  "ERROR", "PEER_LEFT", "STALL",
                                 "PUSH_COMPRESSED", "JOIN", "JOIN_NOTICE", "PUSH_FUSED",
                                 "PULL_REPLY_FUSED", "WORKERS_CHANGED", "HOSTS_UPDATED", "EPOCH",
                                 "CONTROL", "LEAVE"};
  return type <= kMaxMsgType ? kNames[type] : "?";
}

const char* ReduceOpName(uint8_t op) {
  static const char* kNames[] = {"sum", "min", "max", "product"};
  return op <= kMaxReduceOp ? kNames[op] : "unknown";
}

const char* RoleName(Role role) {
  switch (role) {
    case Role::kWorker: return "worker";
    case Role::kServer: return "server";
    case Role::kScheduler: return "scheduler";
    case Role::kLauncher: return "launcher";
  }
  return "?";
}

}  // namespace bps
