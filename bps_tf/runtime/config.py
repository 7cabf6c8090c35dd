"""Every bps_tf setting read from the environment, with its default.

One table so the launcher, the worker, the server and the docs agree. The C++
core receives the resolved values as a ``key=value`` text (see
``to_core_text``); it never reads the environment itself, which keeps it
testable and keeps the defaults in one place.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional

from bps_tf.runtime import security


@dataclass(frozen=True)
class Setting:
    env: str            # environment variable
    core_key: str       # key in the core's config text ("" = Python only)
    default: str
    parse: Callable[[str], object]
    doc: str


def _int(text: str) -> int:
    return int(text, 0)


def _nonnegative_int(text: str) -> int:
    n = int(text, 0)
    if n < 0:
        raise ValueError("it must be 0 (off) or a number of bytes")
    return n


def _cipher_threads(text: str) -> int:
    n = int(text, 0)
    if not 0 <= n <= 16:   # the core's cap (transport/cipher_pool.cc)
        raise ValueError("it must be 0 (automatic) or a number of threads from 1 to 16")
    return n


def parse_link_rate(text: str) -> float:
    """A link rate as tc writes it ('100mbit', '1.5gbit', decimal units) ->
    bytes per second; '' (unset) -> 0."""
    if not text.strip():
        return 0.0
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)bit\s*", text.lower())
    rate = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] / 8 if m else 0
    if rate <= 0:
        raise ValueError("it must be a link rate such as 100mbit, 1gbit or 25gbit")
    return rate


def _nonnegative_float(text: str) -> float:
    x = float(text)
    if not x >= 0:
        raise ValueError("it must be 0 (no limit) or a number of seconds")
    return x


def _milliseconds(text: str) -> float:
    x = float(text)
    if not 0 <= x < float("inf"):
        raise ValueError("it must be 0 (off) or a number of milliseconds")
    return x


def _credit_int(text: str) -> int:
    n = int(text, 0)
    if n < -1:
        raise ValueError("it must be -1 (no limit), 0 (the default) or a number of bytes")
    return n


def _auto_bool(text: str) -> int:
    """0/1, or -1 for "auto" (the core decides)."""
    return -1 if text.strip().lower() == "auto" else _bool(text)


LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


def _encryption(text: str) -> int:
    if text.strip().lower() == "curve":
        return security.ENCRYPTION_CURVE
    try:
        return _bool(text)
    except ValueError:
        raise ValueError("expected 1 (on), 0 (off) or curve (ZeroMQ CURVE)") from None


def _log_level(text: str) -> str:
    level = text.strip().upper() or "WARNING"
    if level == "WARN":
        level = "WARNING"
    if level not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


def _bool(text: str) -> int:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return 1
    if low in ("0", "false", "no", "off", ""):
        return 0
    raise ValueError(f"expected 0/1, got {text!r}")


SETTINGS = (
    # -- the data path --
    Setting("BYTEPS_PARTITION_BYTES", "partition_bytes", "1048576", _int,
            "Largest piece a tensor is cut into before it is pushed; each piece "
            "goes to one server. Must agree on every node. (BytePS uses 4096000; "
            "smaller pieces cross a bandwidth-limited step sooner, with no loss "
            "on one machine down to 1 MiB, and a power of two keeps tensors of "
            "1 MiB, 4 MiB, ... free of a small last piece: docs/performance.md "
            "sections 16 and 18.)"),
    Setting("BYTEPS_LINK_RATE", "", "", parse_link_rate,
            "The rate of each host's link, each way (100mbit, 1gbit, 25gbit), "
            "on every node: below about 2.4 Gbit the partitions, the credit and "
            "TCP_NOTSENT_LOWAT are sized to it instead of to fast links "
            "(credit 20 ms of the link, partitions an eighth of it), so each "
            "server's first sums go back while later pushes still travel. At "
            "100 mbit and 8 workers this took a step from 1.9 s to 1.17 s "
            "(docs/scaling.md#the-edge-as-n-grows). A variable set explicitly "
            "wins; unset: sized for fast links."),
    Setting("BYTEPS_SCHEDULING_CREDIT", "credit_bytes", "0", _int,
            "Bytes a worker may have in flight to the servers at once; the "
            "priority queue decides what leaves next. 0 means 8 partitions."),
    Setting("BYTEPS_SERVER_CREDIT", "server_credit_bytes", "0", _credit_int,
            "Bytes of sums a server may have handed to ZeroMQ for one worker "
            "and not yet written; the rest waits in a queue ordered by the "
            "pushes' priority, so an urgent sum overtakes bulk ones on the "
            "way back. 0 means 4 partitions; -1 no limit (every sum leaves "
            "at once, in the order it is ready)."),
    Setting("BYTEPS_FUSION_THRESHOLD", "fusion_threshold", "262144", _int,
            "Tensor fusion: partitions bound for one server that are ready at "
            "the same time travel in one message of at most this many bytes "
            "(and the servers' replies likewise); only partitions that fit "
            "twice in it are fused. Capped at max(BYTEPS_PARTITION_BYTES, "
            "1 MiB). 0: every partition in its own message. "
            "HOROVOD_FUSION_THRESHOLD is read when this is not set."),
    Setting("BYTEPS_FUSION_CYCLE_TIME_MS", "fusion_cycle_ms", "0", float,
            "Tensor fusion: milliseconds a small partition may wait in the queue "
            "for others to share its message (the wait ends early once a full "
            "message is ready). 0: send what is ready at once. "
            "HOROVOD_CYCLE_TIME is read when this is not set."),
    Setting("BYTEPS_SCHEDULING_BURST_MS", "burst_ms", "10", _milliseconds,
            "While operations arrive in a burst (as a train step's push_pulls "
            "do, in an order that differs from worker to worker), a worker "
            "keeps one partition in flight instead of the full credit, for at "
            "most this many milliseconds from the burst's start, so the "
            "priority queue orders the burst before its bytes are committed "
            "to the link (docs/performance-history.md, \"A train step's "
            "push_pulls leave in priority order on every worker\"). 0: the full "
            "credit at once."),
    Setting("BYTEPS_SCHEDULING_BURST_GAP_MS", "burst_gap_ms", "1", _milliseconds,
            "An operation enqueued within this many milliseconds of the "
            "previous one continues its burst (BYTEPS_SCHEDULING_BURST_MS); "
            "the burst stops limiting the credit this long after its last "
            "operation."),
    Setting("BYTEPS_MALLOC_KEEP_BUFFERS", "malloc_keep_buffers", "1", _bool,
            "Workers and servers ask glibc to keep freed buffers of up to 32 MiB "
            "in the heap (mallopt M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD "
            "512 MiB) so that each message reuses pages instead of mapping "
            "fresh ones and faulting them in (64 MiB push_pull on loopback: "
            "about 25 % faster). Freed memory up to the process's peak stays "
            "mapped. 0: leave glibc's settings (and your GLIBC_TUNABLES) alone."),
    Setting("BYTEPS_SERVER_ENGINE_THREAD", "engine_threads", "4", _int,
            "Threads a server uses to sum the partitions of 64 KiB or more (and the "
            "compressed ones) it owns; smaller ones are summed by its I/O thread, once per "
            "batch received (handing a small sum to another thread costs more than the sum)."),
    Setting("BYTEPS_ENABLE_ASYNC", "async", "0", _bool,
            "Asynchronous parameter-server training: BytePSStrategy defaults to "
            "mode='async' and the Keras DistributedOptimizer pushes weight "
            "deltas and pulls weights instead of averaging gradients. Must "
            "agree on every node. The servers need no switch: a key is "
            "asynchronous by its name (bps_async/...)."),
    Setting("BYTEPS_ASYNC_LOG_STEPS", "", "100", _int,
            "Asynchronous training: every this many steps a worker logs (INFO) "
            "its staleness, the other workers' updates folded in between two "
            "of its own pulls (0: never)."),
    Setting("BYTEPS_OVERLAP", "overlap", "1", _bool,
            "BytePSStrategy's default for overlap=: model.fit starts each step's "
            "gradient push_pulls and applies each layer's update right before its "
            "forward pass in the next step, bit-identical to the barrier; models "
            "it cannot serve exactly keep the barrier with one log line "
            "(docs/overlap.md). 0: a barrier between steps. Must agree on every node."),
    Setting("BYTEPS_EARLY_DATA_CHECK", "", "1", _bool,
            "BytePSStrategy: a worker with a batch of its own starts tf.distribute's "
            "per-step end-of-data sum and goes on; only a worker without one waits "
            "for it (bps_tf/strategy/data_check.py). 0: every worker waits. Must agree on every node."),
    Setting("BYTEPS_OVERLAP_READ_TIMEOUT", "", "600", _nonnegative_float,
            "Seconds a read of an overlapped model's weights from another "
            "thread waits for the train step running now to end (it then "
            "applies the step's pending updates and reads the barrier's "
            "weights) before it fails with an error (0: no limit)."),
    Setting("BYTEPS_MIN_COMPRESS_BYTES", "min_compress_bytes", "4096", _int,
            "Tensors smaller than this many bytes travel uncompressed whatever "
            "compressor is chosen (they gain nothing). Must agree on every node."),
    Setting("BYTEPS_LOCAL_REDUCE", "local_reduce", "auto", _auto_bool,
            "Workers of one host sum through shared memory first and one of "
            "them pushes the host's sum (docs/engine.md#local-reduce). auto: "
            "when the job spans several hosts and one has several workers; 1: "
            "also when every worker is on one host; 0: every worker pushes its "
            "own. Must agree on every node."),
    # -- elastic training (docs/elastic.md) --
    Setting("BYTEPS_ELASTIC", "elastic", "0", _bool,
            "Elastic training: a lost or failed worker starts a new membership epoch "
            "instead of failing the job; the others' operations fail with "
            "bps_tf.elastic.WorkersChangedError, which hvd.elastic.run catches (restore "
            "the last commit, rejoin with dense ranks, go on), and new workers join at "
            "the next epoch. bpslaunch sets it with --min-np/--max-np. Must agree on every node."),
    Setting("BYTEPS_ELASTIC_MIN_WORKERS", "elastic_min_workers", "1", _int,
            "Elastic: the fewest workers the job goes on with (bpslaunch --min-np); "
            "below it the scheduler waits BYTEPS_ELASTIC_TIMEOUT for newcomers, then fails the job."),
    Setting("BYTEPS_ELASTIC_MAX_WORKERS", "elastic_max_workers", "0", _int,
            "Elastic: the most workers the job admits (bpslaunch --max-np); "
            "0: the starting worker count."),
    Setting("BYTEPS_ELASTIC_TIMEOUT", "elastic_timeout_s", "600", float,
            "Elastic: seconds the scheduler waits for enough workers (--min-np) after a "
            "membership change before it fails the job (bpslaunch --elastic-timeout)."),
    Setting("BYTEPS_SCHEDULER_RECOVERY_TIMEOUT", "scheduler_recovery_s", "120", float,
            "Elastic: seconds a worker or server that lost the scheduler (its link broke, "
            "or BYTEPS_TIMEOUT without an answer) keeps re-registering with it, as it may "
            "restart at the same address (bpslaunch or Kubernetes starts it again; "
            "docs/elastic.md), before it fails. A fixed job fails after BYTEPS_TIMEOUT."),
    Setting("BYTEPS_ELASTIC_RESET_LIMIT", "elastic_reset_limit", "-1", _int,
            "Elastic: the scheduler fails the job once its workers would change (a "
            "reset: a loss, a failure, workers added or removed) more than this many "
            "times (bpslaunch --reset-limit). -1: no limit. Read by the scheduler."),
    # -- failures, stalls and time limits --
    Setting("BYTEPS_TIMEOUT", "timeout_s", "30", float,
            "Seconds without a heartbeat after which a peer is declared dead "
            "and every process stops with an error naming it."),
    Setting("BYTEPS_RENDEZVOUS_TIMEOUT", "rendezvous_timeout_s", "120", float,
            "Seconds a node waits for the whole cluster to meet at start-up. "
            "While it waits it logs who is missing every 10 s: at INFO until half "
            "of this has passed (nodes start seconds apart), then as warnings. "
            "The scheduler (also inside server 0) waits a fifth longer plus "
            "2 s, then fails the job naming the nodes that never joined."),
    Setting("BYTEPS_OP_TIMEOUT", "op_timeout_s", "0", float,
            "Seconds one push_pull may wait for the other workers before it "
            "fails (0: the stall settings below decide; dead peers are caught "
            "by BYTEPS_TIMEOUT)."),
    Setting("BYTEPS_STALL_CHECK_TIME_SECONDS", "stall_check_s", "60", float,
            "Seconds after which a tensor that some workers declared (first "
            "push_pull of a name) and others did not is reported, on every "
            "worker, with its name and the missing ranks; and after which a "
            "worker warns of its own push_pull of a name in use that the "
            "others have not matched (0: no check)."),
    Setting("BYTEPS_STALL_SHUTDOWN_TIME_SECONDS", "stall_shutdown_s", "600", float,
            "Seconds after which such a stalled tensor stops the job: every "
            "worker's pending push_pulls fail with the stall message and the "
            "processes exit non-zero; a push_pull of a name in use that waited "
            "this long fails on its worker, unless BYTEPS_OP_TIMEOUT is set "
            "(0: never)."),
    Setting("BYTEPS_FATAL_EXIT_GRACE", "fatal_exit_s", "15", float,
            "After a peer failure, seconds a worker waits for the program to "
            "react to the error before it exits with code 1 (0: never)."),
    Setting("BYTEPS_HEARTBEAT_INTERVAL", "heartbeat_s", "1", float,
            "Seconds between heartbeats each node sends to the scheduler."),
    # -- transport and security --
    Setting("BYTEPS_ZMQ_IO_THREADS", "zmq_io_threads", "1", _int,
            "ZeroMQ I/O threads per process."),
    Setting("BYTEPS_CIPHER_THREADS", "cipher_threads", "0", _cipher_threads,
            "Threads that share the encryption of one large message on sealed "
            "links (BYTEPS_ENCRYPTION=1; messages of 512 KiB and more are cut "
            "into slices of at least 256 KiB, each sealed on its own). 0 picks "
            "min(4, cores / 4): on 2 cores the engine's thread does it alone. "
            "Each node chooses for itself; nodes with different values work "
            "together."),
    Setting("BYTEPS_TCP_NOTSENT_LOWAT", "tcp_notsent_lowat", "262144", _nonnegative_int,
            "Bytes each TCP connection may hold in the kernel not yet sent "
            "(TCP_NOTSENT_LOWAT). The rest waits in bps_tf's priority queue, "
            "where an urgent partition can overtake it; the kernel's default "
            "takes megabytes, all of which an urgent partition would wait "
            "behind. 0 leaves the kernel's default."),
    Setting("BYTEPS_ENABLE_IPC", "enable_ipc", "1", _bool,
            "Workers reach the servers of their own machine (same kernel and "
            "network namespace) over Unix sockets instead of loopback TCP: "
            "the kernel moves bulk data through them 1.4-1.9x as fast. With a "
            "token these links are authenticated with a credential of their "
            "own but not encrypted, whatever BYTEPS_ENCRYPTION says: no "
            "network carries them (docs/reliability.md#security). 0: TCP "
            "everywhere, so BYTEPS_ENCRYPTION=1 encrypts these links too."),
    Setting("BYTEPS_JOB_TOKEN", "", "", str,
            "Per-job secret. Every ZeroMQ connection is authenticated with keys "
            "derived from it, so a process without it cannot connect; with "
            "BYTEPS_ENCRYPTION=1 (the default) the connections are also "
            "encrypted. bpslaunch generates one for local "
            "clusters; set the same value on every node of a multi-host job. "
            "Empty: no authentication and no encryption."),
    Setting("BYTEPS_ALLOW_INSECURE", "", "0", _bool,
            "1 lets a node that is reachable from other hosts (it listens on a non-loopback "
            "address, or its scheduler is on another host) start without "
            "BYTEPS_JOB_TOKEN, with a loud warning: for a network you trust. By default "
            "such a node refuses to start and says how to set a token."),
    Setting("BYTEPS_ENCRYPTION", "encryption", "1", _encryption,
            "With a job token: 1 encrypts and authenticates every network "
            "connection and every message (a handshake keyed by the token, then "
            "an AEAD from libsodium per message: AEGIS-128L on CPUs with AES "
            "instructions, else XChaCha20-Poly1305; the Unix-socket "
            "links of BYTEPS_ENABLE_IPC are authenticated, not encrypted); curve "
            "does the same with ZeroMQ CURVE, about 3x slower; 0, for a trusted "
            "network, sends in clear and only checks a credential derived from the "
            "token (it keeps jobs apart, not an eavesdropper out). Must agree on "
            "every node."),
    # -- timeline and logs --
    Setting("BYTEPS_TRACE_ON", "trace_on", "0", _bool,
            "Write a timeline (Chrome trace / Perfetto JSON) per worker: one "
            "event per tensor and per partition per stage."),
    Setting("BYTEPS_TRACE_DIR", "trace_dir", ".", str,
            "Folder for the timeline files bps_trace_rank<r>.json."),
    Setting("BYTEPS_TRACE_START_STEP", "trace_start_step", "0", _int,
            "First step recorded; a step is one push_pull of a tensor."),
    Setting("BYTEPS_TRACE_END_STEP", "trace_end_step", "20", _int,
            "Last step recorded (-1: no limit; memory grows with the steps)."),
    Setting("BYTEPS_LOG_LEVEL", "log_level", "WARNING", _log_level,
            "DEBUG, INFO, WARNING or ERROR, for the core and the Python logs."),
    # -- read by Python only (strategy, launcher, server) --
    Setting("BYTEPS_FINGERPRINT_STEPS", "", "100", _nonnegative_int,
            "Every this many steps, the workers compare an exact fingerprint of each "
            "variable they train (one small push_pull); a difference fails the step on "
            "every worker, naming the variables and ranks (replicas drifted apart). "
            "Under model.fit the steps count across a model's fit calls and each fit "
            "ends with a check. 0: off."),
    Setting("BYTEPS_PRIORITY_SCHEDULING", "", "1", _bool,
            "Rank gradient push_pulls by the forward pass's topological order "
            "(earliest layer first); 0 sends them first come, first served."),
    Setting("BYTEPS_PROGRESS_ALL_RANKS", "", "0", _bool,
            "Draw Keras' progress bar on every worker, not only on rank 0."),
    Setting("BYTEPS_LAUNCHER_REPORTS", "", "1", _bool,
            "Elastic, bpslaunch -np: the launcher reports to the scheduler at once each "
            "worker it sees end, the workers it removes and the newcomers it starts "
            "(docs/elastic.md). 0: it does not; a lost worker is then noticed after "
            "BYTEPS_TIMEOUT, as without a launcher (for comparisons)."),
    Setting("BYTEPS_HEALTH_PORT", "", "0", _int,
            "Port on which a server or scheduler serves the gRPC health service "
            "(grpc.health.v1, for Kubernetes `grpc` probes): NOT_SERVING until "
            "the cluster has met, SERVING while healthy, NOT_SERVING after a "
            "lost peer. 0: off. bpslaunch -np gives server i this port + i."),
    # -- for tests and tuning --
    Setting("BYTEPS_K8S_TEST_HOSTS", "", "", str,
            "TESTS ONLY, never set in production: name=127.0.0.x,... maps Kubernetes pod "
            "DNS names to loopback addresses, so a job rendered from the manifests runs on one "
            "machine (tests/test_k8s_jobs.py); any other address is refused."),
    Setting("BYTEPS_DEBUG_SEND_LOG", "send_log", "0", _bool,
            "Record the order partitions leave a worker (read with "
            "bps_tf.runtime.basics.debug_send_log()); for tests and tuning."),
)

BY_ENV: Dict[str, Setting] = {s.env: s for s in SETTINGS}
BY_CORE_KEY: Dict[str, Setting] = {s.core_key: s for s in SETTINGS if s.core_key}

# Horovod's names for the same knobs, read when the BytePS name is not set.
ALIASES: Dict[str, str] = {
    "BYTEPS_FUSION_THRESHOLD": "HOROVOD_FUSION_THRESHOLD",
    "BYTEPS_FUSION_CYCLE_TIME_MS": "HOROVOD_CYCLE_TIME",
}


def value(env: str, environ: Optional[Mapping[str, str]] = None):
    """The parsed value of one setting, raising a clear error on bad input."""
    environ = os.environ if environ is None else environ
    setting = BY_ENV[env]
    name = env
    if env not in environ and env in ALIASES and ALIASES[env] in environ:
        name = ALIASES[env]
    text = environ.get(name, setting.default)
    try:
        parsed = setting.parse(text)
    except ValueError as exc:
        raise ValueError(f"{name}={text!r} is not valid: {exc}") from None
    if env in ALIASES and parsed < 0:
        raise ValueError(f"{name}={text!r} is not valid: it must not be negative")
    return parsed


def sized_to_link(rate: float) -> Dict[str, int]:
    """The settings BYTEPS_LINK_RATE gives for a link of ``rate`` bytes per
    second: about 20 ms of the link in flight per worker (rounded to a power
    of two, so tensors of 1 MiB, 4 MiB, ... keep whole partitions), cut into
    8 partitions, and a 32nd of it unsent per TCP connection; never above
    the defaults, which suit links of a few Gbit and more."""
    if rate <= 0:
        return {}
    credit = 1 << max(16, min(23, round(math.log2(rate * 0.020))))
    return {"partition_bytes": min(credit // 8, int(BY_ENV["BYTEPS_PARTITION_BYTES"].default)),
            "tcp_notsent_lowat": min(max(4096, credit // 32),
                                     int(BY_ENV["BYTEPS_TCP_NOTSENT_LOWAT"].default)),
            "credit_bytes": credit}   # last: it is at least one partition


def core_settings(environ: Optional[Mapping[str, str]] = None) -> Dict[str, object]:
    values = {s.core_key: value(s.env, environ) for s in SETTINGS if s.core_key}
    # BYTEPS_LINK_RATE sizes what is not set explicitly (every node derives
    # the same partition size from the same rate).
    env = os.environ if environ is None else environ
    for key, sized in sized_to_link(value("BYTEPS_LINK_RATE", environ)).items():
        if BY_CORE_KEY[key].env not in env:
            values[key] = sized
            if key == "credit_bytes":   # at least one partition of an explicit size
                values[key] = max(sized, int(values["partition_bytes"]))
    # The core gets the keys derived from the token, never the token.
    values.update(security.core_values(value("BYTEPS_JOB_TOKEN", environ), values["encryption"]))
    if values["elastic"] and values["local_reduce"] == -1:
        values["local_reduce"] = 0   # fixed shared-memory groups: not elastic (check_elastic)
    return values


def elastic_newcomer(environ=None) -> bool:
    """A worker started while the job runs (bpslaunch sets BYTEPS_ELASTIC_NEWCOMER=1):
    it has no rank yet and joins at the next membership epoch."""
    env = os.environ if environ is None else environ
    return env.get("BYTEPS_ELASTIC_NEWCOMER", "") == "1"


def check_elastic(values) -> None:
    """What elastic training cannot make exact is refused before joining."""
    if values.get("async"):
        raise ValueError(
            "elastic training (BYTEPS_ELASTIC=1) with asynchronous training "
            "(BYTEPS_ENABLE_ASYNC=1) is not supported: the servers hold the only shared copy "
            "of the weights and every worker's updates are applied as they come, so there is "
            "no commit every worker can roll back to. Use synchronous training.")
    if values.get("local_reduce") == 1:
        raise ValueError(
            "elastic training (BYTEPS_ELASTIC=1) with BYTEPS_LOCAL_REDUCE=1 is not supported: "
            "a host's workers sum through shared memory in fixed groups. Leave it at auto or 0.")


def to_core_text(values: Mapping[str, object]) -> str:
    """Encode settings as the core's ``key=value`` lines."""
    lines = []
    for key, val in values.items():
        text = str(val)
        if "\n" in text or "=" in key:
            raise ValueError(f"setting {key!r} holds a newline")
        lines.append(f"{key}={text}")
    return "\n".join(lines) + "\n"


def tf_keras_enabled() -> bool:
    """True when ``tf.keras`` is tf_keras (Keras 2): ``TF_USE_LEGACY_KERAS``
    set to one of the values TensorFlow itself accepts."""
    return os.environ.get("TF_USE_LEGACY_KERAS", "") in ("1", "true", "True")
