"""The job token turned into the secrets that secure every ZeroMQ connection.

The core never sees the token. Each process that starts the core derives,
with Python's hashlib and hmac, the 32-byte secrets its mode needs from it
and hands them to the core in its config text (``core_values``):

* the link key of BYTEPS_ENCRYPTION=1 (the default): the key of each link's
  handshake (core/transport/link_cipher.h), which proves both ends hold the
  token and, with fresh X25519 keys from each end, gives the link its own
  keys; every message is then sealed with an AEAD from libsodium. Nothing
  derived from the token alone crosses the network: the handshake's MACs
  cover the fresh keys of that link, and the ZeroMQ gate in front of it
  presents a public label (``SEALED_GATE``), not a credential;
* the CURVE server secret key (BYTEPS_ENCRYPTION=curve): servers and the
  scheduler listen with it;
  connecting nodes compute its public key, so only holders of the token can
  even start a handshake with them;
* the CURVE client secret key: every connecting node presents its public
  key, and the listening side admits that key only (a process that knows
  just the server's public key is refused);
* the credential sent, in clear, when BYTEPS_ENCRYPTION=0: it keeps jobs
  apart but is no defence against an eavesdropper, who can replay it;
* the credential of the Unix sockets between a worker and a server of one
  machine (BYTEPS_ENABLE_IPC), which no network carries: those links are
  authenticated with it and not encrypted (core/security.h says why). It is
  never sent over a network, so a credential captured from a job without
  encryption opens no local link of a job with the same token.

Public keys are computed by libzmq (``zmq_curve_public``). Whatever a node
sends can be recorded and used to test guesses of the token offline, so
the token first goes through a slow, memory-hard derivation (scrypt, 16 MiB
per guess: ``_master``), and a node reachable from other hosts refuses a
token that is short or of low entropy (:func:`refuse_weak_token`); every
secret is then an HMAC of that master with its own label, so revealing one
reveals neither the token nor the others (docs/reliability.md#security).
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import math
from typing import Dict

# Changing any of these changes every key: nodes of one job must agree
# (v2: scrypt instead of PBKDF2, with the sealed handshake's version 4).
_SALT = b"bps_tf job token v2"
# libsodium's "interactive" scrypt: 16 MiB and ~0.1 s per derivation, once
# per process; every guess of an offline attack costs the same.
_SCRYPT = dict(n=1 << 14, r=8, p=1, maxmem=64 << 20, dklen=32)
LABELS = {"curve_server_secret": b"curve server", "curve_client_secret": b"curve client",
          "plain_credential": b"plain credential", "local_credential": b"local credential",
          "link_key": b"link key"}
# What a node presents to ZeroMQ's PLAIN gate of a sealed link: public, the
# same for every job (core/transport/security.cc holds the same text); the
# handshake behind it is what admits a node.
SEALED_GATE = "bps_tf sealed links v4"
# BYTEPS_ENCRYPTION's values (config.py parses them).
ENCRYPTION_OFF, ENCRYPTION_ON, ENCRYPTION_CURVE = 0, 1, 2
# A token a node reachable from other hosts accepts (refuse_weak_token).
MIN_TOKEN_BYTES = 16
MIN_TOKEN_BITS = 64
MIN_TOKEN_SYMBOLS = 8
MAKE_TOKEN = "python -c 'import secrets; print(secrets.token_hex(16))'"


@functools.lru_cache(maxsize=4)
def derive(token: str, name: str) -> bytes:
    """The 32-byte secret called `name` (a key of LABELS) for this token."""
    if not token:
        raise ValueError("no job token: nothing to derive")
    master = _master(token)
    return hmac.new(master, LABELS[name], hashlib.sha256).digest()


@functools.lru_cache(maxsize=4)
def _master(token: str) -> bytes:
    return hashlib.scrypt(token.encode("utf-8"), salt=_SALT, **_SCRYPT)


def token_weakness(token: str) -> str:
    """Why ``token`` is too weak to guard a job reachable from other hosts
    ("" when it is not): under MIN_TOKEN_BYTES bytes, under MIN_TOKEN_SYMBOLS
    different characters (``aaaa...``, ``abab...``), or under MIN_TOKEN_BITS
    by a count that gives each character the entropy of its class (digits,
    lower case, upper case, other) -- a generous estimate: a word or a
    pattern scores high and is still guessable, which the slow derivation
    is there for."""
    raw = token.encode("utf-8")
    if len(raw) < MIN_TOKEN_BYTES:
        return f"it is {len(raw)} bytes long (at least {MIN_TOKEN_BYTES})"
    if len(set(token)) < MIN_TOKEN_SYMBOLS:
        return (f"it uses {len(set(token))} different characters (at least "
                f"{MIN_TOKEN_SYMBOLS})")
    pool = sum(size for test, size in ((str.isdigit, 10), (str.islower, 26), (str.isupper, 26))
               if any(test(c) for c in token))
    pool += 33 if any(not (c.isdigit() or c.islower() or c.isupper()) for c in token) else 0
    bits = len(token) * math.log2(max(pool, 2))
    if bits < MIN_TOKEN_BITS:
        return f"it holds about {bits:.0f} bits of entropy (at least {MIN_TOKEN_BITS})"
    return ""


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
    job token that is not weak (:func:`refuse_weak_token`), unless
    BYTEPS_ALLOW_INSECURE=1 says the network is trusted."""
    where = exposure(spec)
    if not where:
        return
    if token:
        refuse_weak_token(spec, token, where, allow_insecure, log)
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
        f"export BYTEPS_JOB_TOKEN=$({MAKE_TOKEN}) "
        f"on one machine and copy it to the others (Kubernetes: from a Secret, "
        f"examples/k8s/README.md). On a network you trust, BYTEPS_ALLOW_INSECURE=1 starts "
        f"without one.")


def refuse_weak_token(spec, token: str, where: str, allow_insecure: bool, log) -> None:
    """A node reachable from other hosts (``where`` says how) refuses a weak
    token: what it sends lets anyone who records it test guesses offline,
    and a weak token falls to a short list of guesses."""
    weakness = token_weakness(token)
    if not weakness:
        return
    if allow_insecure:
        log.warning("bps_tf %s: BYTEPS_ALLOW_INSECURE=1: this node %s with a weak job token "
                    "(%s): anyone who records its traffic may guess it offline.", spec.role,
                    where, weakness)
        return
    raise InsecureClusterError(
        f"bps_tf {spec.role}: refusing a weak BYTEPS_JOB_TOKEN: this node {where} (from "
        f"{spec.source}), and {weakness}. What a node sends lets whoever records it test "
        f"guesses of the token offline, so a job reachable from other hosts needs a random "
        f"one: export BYTEPS_JOB_TOKEN=$({MAKE_TOKEN}) on one machine and copy it to every "
        f"node (Kubernetes: from a Secret, examples/k8s/README.md). On a network you trust, "
        f"BYTEPS_ALLOW_INSECURE=1 accepts it.")


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
    elif chosen == "plain":
        values["plain_credential"] = derive(token, "plain_credential").hex()
    if chosen == "aead":
        values["link_key"] = derive(token, "link_key").hex()
    if chosen != "none":
        values["local_credential"] = derive(token, "local_credential").hex()
    return values


def gate_password(token: str, encryption: int) -> bytes:
    """What this token's nodes present to a listening node's PLAIN gate over
    TCP (for tests and tools that speak to a node): the public label of
    sealed links, or the credential of BYTEPS_ENCRYPTION=0."""
    if mode(token, encryption) == "aead":
        return SEALED_GATE.encode()
    return derive(token, "plain_credential").hex().encode()
