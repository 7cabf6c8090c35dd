"""The standard gRPC health service (``grpc.health.v1``) for servers and schedulers.

Kubernetes (``grpc:`` probes), ``grpc_health_probe`` and load balancers ask
``Check(service)``; a server answers from the state its C++ core reports:

=====================  =========================  ===============================
service                SERVING while              NOT_SERVING while
=====================  =========================  ===============================
``""`` and             the cluster has met and    starting (not all nodes met
``bps_tf.cluster``     no peer was lost           yet), after a lost peer or any
                                                  failure, and while shutting down
``bps_tf.live``        the process runs and has   it failed (a lost peer, a lost
                       not failed (also before    scheduler, a rendezvous
                       the cluster met)           timeout)
=====================  =========================  ===============================

Once the process ends the port closes, which a probe also reports as a
failure. Off unless ``BYTEPS_HEALTH_PORT`` is set (see docs/launcher.md).

grpcio is imported only when the service is turned on, so a server without it
installed still runs. No TensorFlow here.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, Optional

from bps_tf.runtime import cluster

SERVICE_CLUSTER = "bps_tf.cluster"
SERVICE_LIVE = "bps_tf.live"

# The core's node states (Stats::node_state in bps_tf/core/stats.h).
STARTING, MET, ENDING, FAILED = 0, 1, 2, 3
STATE_NAMES = {STARTING: "starting", MET: "cluster met", ENDING: "shutting down",
               FAILED: "failed"}

POLL_INTERVAL_S = 0.2


class HealthError(RuntimeError):
    """The health service cannot run (grpcio missing, port taken)."""


def statuses_for(state: int) -> Dict[str, bool]:
    """service name -> whether it is SERVING, for one core node state."""
    met = state == MET
    return {"": met, SERVICE_CLUSTER: met, SERVICE_LIVE: state != FAILED}


def _import_grpc():
    try:
        import grpc
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    except ImportError as exc:
        raise HealthError(f"BYTEPS_HEALTH_PORT is set but the gRPC health service needs "
                          f"grpcio and grpcio-health-checking ({exc}); install them with "
                          f"`pip install grpcio grpcio-health-checking`") from None
    return grpc, health, health_pb2, health_pb2_grpc


class HealthServer:
    """Serves grpc.health.v1 on ``host:port`` and follows ``read_state()``.

    ``read_state`` returns one of the node states above; a thread polls it and
    updates the statuses, so the caller may block in the core meanwhile.
    """

    def __init__(self, host: str, port: int, read_state: Callable[[], int],
                 poll_interval_s: float = POLL_INTERVAL_S):
        self.host, self.port = host, port
        self._read_state = read_state
        self._poll_s = poll_interval_s
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._server = None
        self._servicer = None
        self._pb2 = None
        self.state: Optional[int] = None

    def start(self) -> int:
        """Listen and start following the state; returns the bound port."""
        grpc, health, health_pb2, health_pb2_grpc = _import_grpc()
        from concurrent import futures
        self._pb2 = health_pb2
        self._servicer = health.HealthServicer()
        # No SO_REUSEPORT (gRPC's default): a second server given the same
        # port must fail, not share the probes with the first.
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2,
                                                              thread_name_prefix="bps-health"),
                                   options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, self._server)
        address = cluster.join_host_port(self.host, self.port)
        try:
            bound = self._server.add_insecure_port(address)
        except RuntimeError as exc:      # recent grpcio raises, older ones return 0
            bound, why = 0, str(exc)
        else:
            why = "the port is taken or the address is not local"
        if not bound:
            raise HealthError(f"cannot serve the gRPC health service on {address} "
                              f"(BYTEPS_HEALTH_PORT): {why}")
        self.port = bound
        self._apply()
        self._server.start()
        self._thread = threading.Thread(target=self._follow, name="bps-health-state", daemon=True)
        self._thread.start()
        return bound

    def _apply(self) -> None:
        try:
            state = int(self._read_state())
        except Exception:                # a broken reader must not kill the server
            state = FAILED
        if state == self.state:
            return
        self.state = state
        self._set_all(statuses_for(state))

    def _set_all(self, serving: Dict[str, bool]) -> None:
        enum = self._pb2.HealthCheckResponse
        for service, ok in serving.items():
            self._servicer.set(service, enum.SERVING if ok else enum.NOT_SERVING)

    def _follow(self) -> None:
        while not self._stopped.wait(self._poll_s):
            self._apply()

    def stop(self, failed: bool = False, grace_s: float = 0.5) -> None:
        """Report NOT_SERVING (and not live if ``failed``), then close the port."""
        if self._server is None:
            return
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._set_all(statuses_for(FAILED if failed else ENDING))
        self._server.stop(grace_s).wait(grace_s + 1)
        self._server = None


def core_state_reader(core) -> Callable[[], int]:
    """Reads the node state from the core's stats (0 for a core that has none)."""
    import json

    def read() -> int:
        return int(json.loads(core.stats_json()).get("node_state", STARTING))
    return read
