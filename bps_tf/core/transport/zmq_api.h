// The part of the libzmq C API bps_tf uses, declared here so the build needs
// no ZeroMQ headers. libzmq itself is loaded at run time (pyzmq's bundled
// copy, see bps_tf/runtime/loader.py), so nothing links against it at build time.
// The values below are the documented, stable libzmq 4.x ABI; a test checks
// them against pyzmq's constants.
#ifndef BPS_TF_CORE_TRANSPORT_ZMQ_API_H_
#define BPS_TF_CORE_TRANSPORT_ZMQ_API_H_

#include <stddef.h>

extern "C" {

struct zmq_msg_t {
  alignas(8) unsigned char opaque[64];
};
typedef void(zmq_free_fn)(void* data, void* hint);
struct zmq_pollitem_t {
  void* socket;
  int fd;
  short events;
  short revents;
};

void* zmq_ctx_new(void);
int zmq_ctx_term(void* context);
int zmq_ctx_set(void* context, int option, int value);
int zmq_ctx_get(void* context, int option);
void* zmq_socket(void* context, int type);
int zmq_close(void* socket);
int zmq_setsockopt(void* socket, int option, const void* value, size_t len);
int zmq_getsockopt(void* socket, int option, void* value, size_t* len);
int zmq_bind(void* socket, const char* endpoint);
int zmq_connect(void* socket, const char* endpoint);
int zmq_msg_init(zmq_msg_t* msg);
int zmq_msg_init_size(zmq_msg_t* msg, size_t size);
int zmq_msg_init_data(zmq_msg_t* msg, void* data, size_t size,
                      zmq_free_fn* ffn, void* hint);
int zmq_msg_send(zmq_msg_t* msg, void* socket, int flags);
int zmq_msg_recv(zmq_msg_t* msg, void* socket, int flags);
int zmq_msg_close(zmq_msg_t* msg);
int zmq_msg_copy(zmq_msg_t* dest, zmq_msg_t* src);
int zmq_msg_move(zmq_msg_t* dest, zmq_msg_t* src);
void* zmq_msg_data(zmq_msg_t* msg);
size_t zmq_msg_size(const zmq_msg_t* msg);
int zmq_msg_more(const zmq_msg_t* msg);
int zmq_poll(zmq_pollitem_t* items, int count, long timeout_ms);
int zmq_socket_monitor(void* socket, const char* endpoint, int events);
int zmq_has(const char* capability);
char* zmq_z85_encode(char* dest, const unsigned char* data, size_t size);
int zmq_curve_public(char* z85_public_key, const char* z85_secret_key);
int zmq_curve_keypair(char* z85_public_key, char* z85_secret_key);
int zmq_errno(void);
const char* zmq_strerror(int errnum);
void zmq_version(int* major, int* minor, int* patch);

}  // extern "C"

namespace zmqc {
// Socket types.
constexpr int kPair = 0;
constexpr int kRep = 4;
constexpr int kDealer = 5;
constexpr int kRouter = 6;
// Send/receive flags.
constexpr int kDontWait = 1;
constexpr int kSndMore = 2;
// Poll events.
constexpr int kPollIn = 1;
constexpr int kPollOut = 2;
// Socket options.
constexpr int kRoutingId = 5;
constexpr int kSndBuf = 11;
constexpr int kRcvBuf = 12;
constexpr int kFd = 14;      // the socket's signal fd (an int on POSIX)
constexpr int kEvents = 15;  // kPollIn / kPollOut the socket has now
constexpr int kLinger = 17;
constexpr int kReconnectIvl = 18;
constexpr int kBacklog = 19;
constexpr int kMaxMsgSize = 22;
constexpr int kSndHwm = 23;
constexpr int kRcvHwm = 24;
constexpr int kLastEndpoint = 32;
constexpr int kRouterMandatory = 33;
constexpr int kPlainServer = 44;
constexpr int kPlainUsername = 45;
constexpr int kPlainPassword = 46;
constexpr int kCurveServer = 47;
constexpr int kCurvePublicKey = 48;
constexpr int kCurveSecretKey = 49;
constexpr int kCurveServerKey = 50;
constexpr int kZapDomain = 55;
// Socket monitor events of a new TCP connection; the value is its fd.
constexpr int kEventConnected = 1;
constexpr int kEventAccepted = 32;
// A connecting socket closed its file descriptor (an attempt failed).
constexpr int kEventClosed = 128;
// A connection this socket opened broke (the peer's process ended, or the
// network dropped it); libzmq reconnects on its own.
constexpr int kEventDisconnected = 512;
// Socket monitor events about the security handshake (libzmq >= 4.3).
constexpr int kEventHandshakeFailedNoDetail = 2048;
constexpr int kEventHandshakeSucceeded = 4096;
constexpr int kEventHandshakeFailedProtocol = 8192;
constexpr int kEventHandshakeFailedAuth = 16384;
// Values a kEventHandshakeFailedProtocol event carries.
constexpr int kProtocolErrorCryptographic = 285212673;     // 0x11000001
constexpr int kProtocolErrorMechanismMismatch = 285212674;  // 0x11000002
// Context options.
constexpr int kIoThreads = 1;
constexpr int kMaxSockets = 2;
constexpr int kSocketLimit = 3;
// Error numbers beyond errno.h.
constexpr int kHausnumero = 156384712;
constexpr int kETerm = kHausnumero + 53;
}  // namespace zmqc

#endif  // BPS_TF_CORE_TRANSPORT_ZMQ_API_H_
