"""The job token turned into the secrets that secure every ZeroMQ connection.

The core never sees the token. Each process that starts the core derives,
with Python's hashlib and hmac, the 32-byte secrets its mode needs from it
(of these four) and hands them to the core in its config text (``core_values``):

* the link key of BYTEPS_ENCRYPTION=1 (the default): the key of each link's
  handshake (core/transport/link_cipher.h), which proves both ends hold the
  token and, with fresh X25519 keys from each end, gives the link its own
  keys; every message is then sealed with an AEAD from libsodium;
* the CURVE server secret key (BYTEPS_ENCRYPTION=curve): servers and the
  scheduler listen with it;
  connecting nodes compute its public key, so only holders of the token can
  even start a handshake with them;
* the CURVE client secret key: every connecting node presents its public
  key, and the listening side admits that key only (a process that knows
  just the server's public key is refused);
* the credential sent, in clear, when BYTEPS_ENCRYPTION=0 or 1: it keeps
  jobs apart but is no defence against an eavesdropper, who can replay it
  (with encryption on it is only a gate: a process that passes it and lacks
  the link key has every message refused);
* the credential of the Unix sockets between a worker and a server of one
  machine (BYTEPS_ENABLE_IPC), which no network carries: those links are
  authenticated with it and not encrypted (core/security.h says why). It is
  never sent over a network, so a credential captured from a job without
  encryption opens no local link of a job with the same token.

Public keys are computed by libzmq (``zmq_curve_public``). A slow
derivation (PBKDF2) first turns the token into a master secret, so a weak,
guessable token costs an attacker many hash computations per guess; every
secret is then an HMAC of that master with its own label, so revealing one
(the clear-text credential) reveals neither the token nor the others.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
from typing import Dict

# Changing any of these changes every key: nodes of one job must agree.
_SALT = b"bps_tf job token v1"
_ITERATIONS = 100_000
LABELS = {"curve_server_secret": b"curve server", "curve_client_secret": b"curve client",
          "plain_credential": b"plain credential", "local_credential": b"local credential",
          "link_key": b"link key"}
# BYTEPS_ENCRYPTION's values (config.py parses them).
ENCRYPTION_OFF, ENCRYPTION_ON, ENCRYPTION_CURVE = 0, 1, 2


@functools.lru_cache(maxsize=4)
def derive(token: str, name: str) -> bytes:
    """The 32-byte secret called `name` (a key of LABELS) for this token."""
    if not token:
        raise ValueError("no job token: nothing to derive")
    master = _master(token)
    return hmac.new(master, LABELS[name], hashlib.sha256).digest()


@functools.lru_cache(maxsize=4)
def _master(token: str) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", token.encode("utf-8"), _SALT, _ITERATIONS)


class InsecureClusterError(RuntimeError):
    """A node would talk over a network without a job token."""


# What a node that refuses to start exits with, servers and workers alike
# (bps_tf/runtime/server.py, basics.refuse_to_start): a setting to fix, not a crash.
EXIT_REFUSED = 2


def exposure(spec) -> str:
    """How this node would be reachable from other hosts ("" if not):
    it listens on a non-loopback address, or meets a scheduler on one."""
    from bps_tf.runtime import cluster
    if spec.role in ("server", "scheduler") and not cluster.is_loopback(spec.bind_host):
        shown = "every address of this host" if spec.bind_host in ("0.0.0.0", "::") \
            else spec.bind_host
        return f"would listen on {shown} (BYTEPS_BIND_HOST={spec.bind_host})"
    if spec.role in ("worker", "server") and spec.scheduler_host and \
            not cluster.is_loopback(spec.scheduler_host):
        return f"would connect to the scheduler at {spec.scheduler_host} over the network"
    return ""


def refuse_unprotected(spec, token: str, allow_insecure: bool, log) -> None:
    """Protected mode: a node reachable from other hosts starts only with a
    job token, unless BYTEPS_ALLOW_INSECURE=1 says the network is trusted."""
    if token:
        return
    where = exposure(spec)
    if not where:
        return
    if allow_insecure:
        log.warning("bps_tf %s: BYTEPS_ALLOW_INSECURE=1: this node %s with NO job token: "
                    "every connection is neither authenticated nor encrypted; anyone who can "
                    "reach these ports can join the job and read or change its tensors.",
                    spec.role, where)
        return
    raise InsecureClusterError(
        f"bps_tf {spec.role}: refusing to start without a job token: this node {where} "
        f"(from {spec.source}), and without BYTEPS_JOB_TOKEN no connection is authenticated or "
        f"encrypted -- anyone who can reach the ports could join the job or read its tensors. "
        f"Set the same secret on every node (workers and servers), e.g. "
        f"export BYTEPS_JOB_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(16))') "
        f"on one machine and copy it to the others (Kubernetes: from a Secret, "
        f"examples/k8s/README.md). On a network you trust, BYTEPS_ALLOW_INSECURE=1 starts "
        f"without one.")


def mode(token: str, encryption: int) -> str:
    """'aead' (a token, encryption on), 'curve' (BYTEPS_ENCRYPTION=curve),
    'plain' (a token, encryption off) or 'none' (no token)."""
    if not token:
        return "none"
    return {ENCRYPTION_OFF: "plain", ENCRYPTION_CURVE: "curve"}.get(encryption, "aead")


def core_values(token: str, encryption: int) -> Dict[str, str]:
    """The core's config entries for this token and BYTEPS_ENCRYPTION."""
    chosen = mode(token, encryption)
    values = {"link_security": chosen}
    if chosen == "curve":
        for name in ("curve_server_secret", "curve_client_secret"):
            values[name] = derive(token, name).hex()
    elif chosen in ("plain", "aead"):
        values["plain_credential"] = derive(token, "plain_credential").hex()
    if chosen == "aead":
        values["link_key"] = derive(token, "link_key").hex()
    if chosen != "none":
        values["local_credential"] = derive(token, "local_credential").hex()
    return values
