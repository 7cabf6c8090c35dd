"""This node's server (or scheduler) role: `python -m bps_tf.server` runs it.

Never imports TensorFlow: parameter servers are cheap CPU processes that
start in a fraction of a second. With ``BYTEPS_HEALTH_PORT`` set, the process
also serves the gRPC health service (see bps_tf/runtime/health.py).
"""
from __future__ import annotations

import logging
import sys

from bps_tf.runtime import cluster, config, security
from bps_tf.runtime.loader import load_core

log = logging.getLogger("bps_tf")


def _start_health(spec: cluster.ClusterConfig, core):
    """The running health server, None when turned off; raises HealthError."""
    port = config.value("BYTEPS_HEALTH_PORT")
    if not port:
        return None
    from bps_tf.runtime import health
    if not 0 < port < 65536:
        raise health.HealthError(f"BYTEPS_HEALTH_PORT={port} is not a port (1-65535, or 0: off)")
    server = health.HealthServer(spec.bind_host, port, health.core_state_reader(core))
    server.start()
    return server


def main(argv=None) -> int:
    try:
        spec = cluster.resolve()
        values = dict(config.core_settings())
        config.value("BYTEPS_HEALTH_PORT")
    except ValueError as exc:
        print(f"bps_tf server: {exc}", file=sys.stderr)
        return 2
    if spec.role not in ("server", "scheduler"):
        print(f"bps_tf server: this node's role is '{spec.role}', not server or scheduler "
              "(set DMLC_ROLE=server, a TF_CONFIG task of type 'ps', or run it in a pod "
              "of a Kubernetes job named server)", file=sys.stderr)
        return 2
    try:
        security.refuse_unprotected(spec, config.value("BYTEPS_JOB_TOKEN"),
                                    config.value("BYTEPS_ALLOW_INSECURE"), log)
    except security.InsecureClusterError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    values.update(spec.core_values())
    core = load_core()
    try:
        health_server = _start_health(spec, core)
    except RuntimeError as exc:     # HealthError: no grpcio, or the port is taken
        print(f"bps_tf {spec.role}: {exc}", file=sys.stderr)
        return 2
    code = 1
    try:
        code, error = core.server_run(config.to_core_text(values))
        if code != 0:
            print(f"bps_tf {spec.role}: {error}", file=sys.stderr)
    finally:
        if health_server is not None:
            health_server.stop(failed=code != 0)
    return code


if __name__ == "__main__":
    sys.exit(main())
