// Frame authentication: every frame's header carries the first 16 bytes of
// HMAC-SHA256(job token, header with this field zeroed). A process without
// the job's token (BYTEPS_JOB_TOKEN) cannot produce a frame any node
// accepts. Only the header is covered, which keeps the cost per frame to a
// few hash blocks whatever the payload size; the header binds the sender,
// key, round and payload size, so an outsider can neither push nor pull.
// Payload confidentiality is out of scope (see docs/reliability.md).
#ifndef BPS_TF_CORE_AUTH_H_
#define BPS_TF_CORE_AUTH_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace bps {

void Sha256(const void* data, size_t len, uint8_t out[32]);
void HmacSha256(const std::string& key, const void* data, size_t len, uint8_t out[32]);

// Process-wide job token; empty disables authentication.
void SetJobToken(const std::string& token);
bool AuthEnabled();
// Writes the authenticator into a 64-byte header (its last 16 bytes).
void SealHeader(void* header64);
// True if the header's authenticator is right (always true when disabled).
bool HeaderAuthentic(const void* header64);

}  // namespace bps

#endif  // BPS_TF_CORE_AUTH_H_
