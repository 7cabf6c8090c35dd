// Whether the loaded libzmq runs CURVE (BYTEPS_ENCRYPTION=curve) on
// libsodium or on the TweetNaCl it bundles when built without libsodium
// (what a pyzmq built from source on a machine without libsodium gets).
// TweetNaCl is a compact reference implementation: measured here it
// encrypted CURVE at 24 MB/s, against 181 MB/s for libzmq with libsodium
// (docs/reliability.md#security), which made push_pull with CURVE ~50x
// slower than clear on one machine without a word.
#ifndef BPS_TF_CORE_TRANSPORT_CURVE_CHECK_H_
#define BPS_TF_CORE_TRANSPORT_CURVE_CHECK_H_

#include <string>

namespace bps {

struct CurveBackend {
  std::string libzmq;            // the file of the loaded libzmq ("" if not found)
  bool links_libsodium = false;  // its dynamic section needs a libsodium
  bool measured = false;         // a probe ran (only when it does not link one)
  double curve_mb_s = 0;         // CURVE through libzmq over loopback TCP, in one process
  double clear_mb_s = 0;         // the same without CURVE
  bool slow() const;             // CURVE as slow as TweetNaCl's
};

// Looks at the libzmq file; with measure (and no libsodium linked), also
// times 2 MiB through CURVE and through clear (tens of milliseconds).
CurveBackend CheckCurveBackend(bool measure);
// The warning for BYTEPS_ENCRYPTION=curve on such a libzmq; "" when fine.
std::string CurveSlowWarning();

}  // namespace bps

#endif  // BPS_TF_CORE_TRANSPORT_CURVE_CHECK_H_
