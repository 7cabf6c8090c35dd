// A few threads that share the AEAD of one large sealed message
// (BYTEPS_CIPHER_THREADS). An engine's I/O thread seals and opens every
// message of its process; AEGIS runs at about 8 GB/s on one core, so on a
// machine with cores to spare a worker would otherwise wait on one core's
// cipher while the others idle. Slices of a message are sealed under
// nonces of their own (link_cipher.h), so they need no order between them.
#ifndef BPS_TF_CORE_TRANSPORT_CIPHER_POOL_H_
#define BPS_TF_CORE_TRANSPORT_CIPHER_POOL_H_

#include <functional>

namespace bps {

// Threads that may work on one message, the caller included; 0 picks
// min(4, cores / 4), so a 2-core machine keeps the cipher on the caller.
void SetCipherThreads(int n);
int CipherThreads();

// Runs fn(0) .. fn(n - 1) and returns once all are done; the caller runs a
// share. While another caller's job runs, this one runs all of its own.
void RunSlices(int n, const std::function<void(int)>& fn);

}  // namespace bps

#endif  // BPS_TF_CORE_TRANSPORT_CIPHER_POOL_H_
