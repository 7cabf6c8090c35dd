// Whether the loaded libzmq runs CURVE (BYTEPS_ENCRYPTION=curve) on
// libsodium or on the TweetNaCl it bundles when built without libsodium
// (what a pyzmq built from source on a machine without libsodium gets).
// TweetNaCl is a compact reference implementation: measured here (libzmq
// 4.3.4 built from source without libsodium) CURVE moved 26 MB/s between
// two sockets, against 192 MB/s for pyzmq's wheel (libzmq on libsodium) and
// ~2 GB/s in clear (docs/reliability.md#security): the likely cause of the
// ~50x slower encrypted push_pull recorded in docs/gpu.md.
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
