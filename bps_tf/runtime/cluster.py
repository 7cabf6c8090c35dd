"""Where this process sits in a bps_tf job, read from the environment.

A process learns its place from one of three sources, in this order:

* ``DMLC_*`` / ``BYTEPS_*`` variables (BytePS names), set by ``bpslaunch -np``
  or by hand; they win whenever ``DMLC_ROLE`` is set;
* ``TF_CONFIG`` (TensorFlow's cluster description, written e.g. by Kubeflow's
  TFJob), used when ``DMLC_ROLE`` is absent;
* a Kubernetes pod's own variables (a JobSet's or an Indexed Job's, see
  k8s_cluster.py), when neither of the others is set.

With none, the process runs alone (role ``local``). ``resolve`` turns the
environment into a ``ClusterConfig`` and rejects anything inconsistent with a
``ClusterSpecError`` that names the variable, the bad value and the fix, so a
misconfigured pod fails at start-up instead of hanging at rendezvous.

This module must stay free of TensorFlow: the launcher and the server import it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

from bps_tf.runtime import k8s_cluster
from bps_tf.runtime.placement import (  # noqa: F401 (ClusterConfig & co. are this module's API)
    DEFAULT_BIND_HOST, LOOPBACK_BIND_HOST, ClusterConfig, ClusterSpecError, is_loopback)
from bps_tf.runtime.placement import choose_bind_host as _bind_host
from bps_tf.runtime.placement import flag_var as _flag_var
from bps_tf.runtime.placement import int_var as _int_var
from bps_tf.runtime.placement import strip_brackets as _strip_brackets

ROLES = ("local", "worker", "server", "scheduler", "evaluator")
DMLC_ROLES = ("worker", "server", "scheduler")
TF_TASK_TYPES = ("chief", "master", "worker", "ps", "evaluator")
_MAX_PORT = 65535
_SHOWN_CHARS = 200   # how much of a bad TF_CONFIG an error message quotes


def resolve(environ: Optional[Mapping[str, str]] = None) -> ClusterConfig:
    """This process's place in the job, from ``DMLC_*``, ``TF_CONFIG``, Kubernetes or none."""
    environ = os.environ if environ is None else environ
    if environ.get("DMLC_ROLE", "").strip():
        cfg = _resolve_dmlc(environ)
    elif environ.get("TF_CONFIG", "").strip():
        cfg = _resolve_tf_config(environ["TF_CONFIG"], environ)
    elif k8s_cluster.configured(environ):
        cfg = k8s_cluster.resolve(environ)
    else:
        cfg = _alone("local", source="none")
    _apply_local_overrides(cfg, environ)
    return cfg


def describe(cfg: ClusterConfig) -> str:
    """One line for logs saying what this process is in the job."""
    origin = f"(from {cfg.source}, host {cfg.hostname})"
    scheduler = join_host_port(cfg.scheduler_host, cfg.scheduler_port)
    if cfg.role == "local":
        return f"bps_tf: single process, no cluster configured {origin}"
    if cfg.role == "evaluator":
        return f"bps_tf evaluator: runs alone, outside the training cluster {origin}"
    if cfg.role == "worker":
        rank = f"rank {cfg.rank}" if cfg.rank >= 0 else "(newcomer: joins the running job)"
        return (f"bps_tf worker {rank} of {cfg.num_workers}, "
                f"{cfg.num_servers} server(s), scheduler {scheduler} {origin}")
    binds = join_host_port(cfg.bind_host, cfg.port) if cfg.port else f"{cfg.bind_host}:<free port>"
    if cfg.role == "scheduler":
        return (f"bps_tf scheduler on {binds} for {cfg.num_workers} worker(s) and "
                f"{cfg.num_servers} server(s) {origin}")
    server = f"server {cfg.server_id}" if cfg.server_id >= 0 else "server (id assigned by the scheduler)"
    hosting = ", hosts the scheduler" if cfg.host_scheduler else f", scheduler {scheduler}"
    return (f"bps_tf {server} of {cfg.num_servers}{hosting}, binds {binds}, advertises "
            f"{cfg.advertise_host}, {cfg.num_workers} worker(s) {origin}")


def split_host_port(address: object, where: str) -> Tuple[str, int]:
    """``"host:port"`` or ``"[v6addr]:port"`` -> (host without brackets, port)."""
    fix = f"write {where} as host:port, with IPv6 addresses in brackets ([::1]:2222)"
    if not isinstance(address, str) or not address.strip():
        raise ClusterSpecError(f"{where} is {address!r}, not a host:port address; {fix}")
    text = address.strip()
    if text.startswith("["):
        close = text.find("]")
        if close < 0 or text[close + 1:close + 2] != ":":
            raise ClusterSpecError(f"{where} is {address!r}, not a host:port address; {fix}")
        host, port_text = text[1:close], text[close + 2:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ClusterSpecError(f"{where} is {address!r}, which has no port; {fix}")
        if ":" in host:
            raise ClusterSpecError(
                f"{where} is {address!r}: an IPv6 address needs brackets; {fix}")
    if not host:
        raise ClusterSpecError(f"{where} is {address!r}, which has no host; {fix}")
    if not port_text.isdigit() or not 1 <= int(port_text) <= _MAX_PORT:
        raise ClusterSpecError(
            f"{where} is {address!r}: the port must be a number from 1 to {_MAX_PORT}; {fix}")
    return host, int(port_text)


def join_host_port(host: str, port: int) -> str:
    """The inverse of ``split_host_port``: brackets IPv6 hosts."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --------------------------------------------------------------------- DMLC_*

def _resolve_dmlc(environ: Mapping[str, str]) -> ClusterConfig:
    role = environ["DMLC_ROLE"].strip().lower()
    if role not in DMLC_ROLES:
        raise ClusterSpecError(
            f"DMLC_ROLE={environ['DMLC_ROLE']!r} is not a role bps_tf knows; set it to "
            f"'worker', 'server' or 'scheduler', or unset it to use TF_CONFIG")
    num_workers = _int_var(environ, "DMLC_NUM_WORKER", minimum=1,
                           fix="set it to the number of training processes")
    num_servers = _int_var(environ, "DMLC_NUM_SERVER", minimum=1,
                           fix="bps_tf needs at least one server to sum gradients; "
                               "set it to the number of server processes")
    root_host = _host_var(environ, "DMLC_PS_ROOT_URI")
    root_port = _int_var(environ, "DMLC_PS_ROOT_PORT", minimum=0, maximum=_MAX_PORT,
                         fix="set it to the scheduler's port")
    cfg = ClusterConfig(
        role=role, num_workers=num_workers, num_servers=num_servers,
        scheduler_host=root_host, scheduler_port=root_port,
        advertise_host=_strip_brackets(environ.get("DMLC_NODE_HOST", "").strip()) or root_host,
        bind_host=_bind_host(environ, [root_host, environ.get("DMLC_NODE_HOST", "").strip()],
                             _strip_brackets(environ.get("DMLC_NODE_HOST", "").strip())
                             or root_host),
        ready_file=environ.get("BYTEPS_READY_FILE", "").strip(),
        source="DMLC")
    if role == "worker":
        cfg.rank = _int_var(environ, "DMLC_WORKER_ID", minimum=0, maximum=num_workers - 1,
                            fix=f"give each of the DMLC_NUM_WORKER={num_workers} workers a "
                                f"distinct id from 0 to {num_workers - 1}")
        _require_known_scheduler_port(root_port, "a worker must know where to connect")
    elif role == "server":
        _fill_dmlc_server(cfg, environ)
    else:
        cfg.port = root_port
        cfg.advertise_host = root_host
        _require_port_reportable(cfg, "the scheduler")
    return cfg


def _fill_dmlc_server(cfg: ClusterConfig, environ: Mapping[str, str]) -> None:
    cfg.server_id = _int_var(environ, "BYTEPS_SERVER_ID", default=-1, minimum=-1,
                             maximum=cfg.num_servers - 1,
                             fix=f"use a distinct id from 0 to {cfg.num_servers - 1} per server, "
                                 f"or -1 to let the scheduler assign one")
    server_port = _int_var(environ, "BYTEPS_SERVER_PORT", default=0, minimum=0,
                           maximum=_MAX_PORT, fix="use 0 to let the OS pick a free port")
    cfg.host_scheduler = _flag_var(environ, "BYTEPS_HOST_SCHEDULER")
    if not cfg.host_scheduler:
        _require_known_scheduler_port(cfg.scheduler_port, "a server must know where to connect")
        cfg.port = server_port
        return
    # The scheduler shares the server's socket, so the server binds the scheduler port.
    if server_port and server_port != cfg.scheduler_port:
        raise ClusterSpecError(
            f"BYTEPS_SERVER_PORT={server_port} disagrees with DMLC_PS_ROOT_PORT="
            f"{cfg.scheduler_port}: with BYTEPS_HOST_SCHEDULER=1 the server binds the "
            f"scheduler port; unset BYTEPS_SERVER_PORT or make the two equal")
    cfg.port = cfg.scheduler_port
    _require_port_reportable(cfg, "the server hosting the scheduler")


def _require_known_scheduler_port(port: int, why: str) -> None:
    if port == 0:
        raise ClusterSpecError(
            f"DMLC_PS_ROOT_PORT=0 is only valid for the process that hosts the scheduler "
            f"({why}); set it to the scheduler's actual port")


def _require_port_reportable(cfg: ClusterConfig, who: str) -> None:
    # Port 0 means "pick one"; nobody could learn it unless it is written down.
    if cfg.port == 0 and not cfg.ready_file:
        raise ClusterSpecError(
            f"DMLC_PS_ROOT_PORT=0 asks {who} to pick a free port, but BYTEPS_READY_FILE is "
            f"not set, so no one could learn it; set DMLC_PS_ROOT_PORT to a fixed port or "
            f"set BYTEPS_READY_FILE to a path the port is written to")


# ---------------------------------------------------------------- TF_CONFIG

@dataclass
class _TfCluster:
    chiefs: List[Tuple[str, int]]
    workers: List[Tuple[str, int]]      # chief first, then the "worker" job
    ps: List[Tuple[str, int]]
    evaluators: List[Tuple[str, int]]


def _resolve_tf_config(text: str, environ: Mapping[str, str]) -> ClusterConfig:
    spec = _parse_tf_config(text)
    jobs = _cluster_jobs(spec)
    tf = _tf_cluster(jobs)
    task_type, index = _task(spec)

    if task_type == "evaluator":
        _check_index(index, tf.evaluators, "evaluator", required=bool(tf.evaluators))
        cfg = _alone("evaluator", source="TF_CONFIG")
        if tf.evaluators:
            cfg.advertise_host = tf.evaluators[index][0]
        return cfg
    if not tf.workers:
        raise ClusterSpecError(
            "TF_CONFIG's cluster has no 'chief' or 'worker' task, so nothing would train; "
            "add at least one worker to the cluster")

    if task_type in ("chief", "master"):
        _check_index(index, tf.chiefs, task_type)
        rank = index
    elif task_type == "worker":
        _check_index(index, jobs.get("worker", []), "worker")
        rank = len(tf.chiefs) + index
    else:  # ps
        _check_index(index, tf.ps, "ps")
        rank = -1

    if not tf.ps:
        if len(tf.workers) == 1:
            return _alone("local", source="TF_CONFIG")
        raise ClusterSpecError(
            f"TF_CONFIG's cluster has {len(tf.workers)} workers and no 'ps' task: "
            f"bps_tf needs at least one 'ps' task to sum gradients; add ps tasks to "
            f"TF_CONFIG's cluster")

    scheduler_host, scheduler_port = tf.ps[0]
    cfg = ClusterConfig(
        role="worker" if rank >= 0 else "server", rank=rank,
        num_workers=len(tf.workers), num_servers=len(tf.ps),
        scheduler_host=scheduler_host, scheduler_port=scheduler_port,
        bind_host=_bind_host(environ, [h for h, _ in tf.workers + tf.ps],
                             tf.ps[index][0] if rank < 0 else tf.workers[rank][0]),
        ready_file=environ.get("BYTEPS_READY_FILE", "").strip(),
        source="TF_CONFIG")
    if rank >= 0:
        cfg.advertise_host = tf.workers[rank][0]
    else:
        cfg.server_id = index
        cfg.advertise_host, cfg.port = tf.ps[index]
        cfg.host_scheduler = index == 0   # ps:0 runs the scheduler on its own socket
    return cfg


def _parse_tf_config(text: str) -> dict:
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClusterSpecError(
            f"TF_CONFIG is not valid JSON ({exc}): {_shorten(text)}; set it to "
            f'{{"cluster": {{...}}, "task": {{"type": ..., "index": ...}}}}') from None
    if not isinstance(spec, dict):
        raise ClusterSpecError(
            f"TF_CONFIG must be a JSON object with 'cluster' and 'task', got {_shorten(text)}")
    if "sparseCluster" in spec:
        raise ClusterSpecError(
            "TF_CONFIG uses 'sparseCluster' (dynamic membership), which bps_tf does not "
            "support: every worker and ps must be known at start; use 'cluster' with the full list")
    return spec


def _cluster_jobs(spec: dict) -> Dict[str, List[str]]:
    raw = spec.get("cluster")
    if not isinstance(raw, dict) or not raw:
        raise ClusterSpecError(
            f"TF_CONFIG has no 'cluster' object (got {raw!r}); add "
            f'"cluster": {{"worker": ["host:port", ...], "ps": ["host:port", ...]}}')
    jobs: Dict[str, List[str]] = {}
    for name, addresses in raw.items():
        job = str(name).strip().lower()
        if job not in TF_TASK_TYPES:
            raise ClusterSpecError(
                f"TF_CONFIG's cluster has a job {name!r} that bps_tf does not know; "
                f"use only {', '.join(TF_TASK_TYPES)}")
        if job in jobs:
            raise ClusterSpecError(f"TF_CONFIG's cluster lists the job {name!r} twice")
        if not isinstance(addresses, list):
            raise ClusterSpecError(
                f"TF_CONFIG's cluster job {name!r} must be a list of host:port strings, "
                f"got {addresses!r}")
        jobs[job] = addresses
    if "chief" in jobs and "master" in jobs:
        raise ClusterSpecError(
            "TF_CONFIG's cluster has both 'chief' and 'master' (the same job under two "
            "names); keep only 'chief'")
    return jobs


def _tf_cluster(jobs: Dict[str, List[str]]) -> _TfCluster:
    chief_key = "master" if "master" in jobs else "chief"
    parsed: Dict[str, List[Tuple[str, int]]] = {}
    seen: Dict[Tuple[str, int], str] = {}
    for job, addresses in jobs.items():
        parsed[job] = []
        for i, address in enumerate(addresses):
            where = f"TF_CONFIG's {job}:{i} address"
            host, port = split_host_port(address, where)
            key = (host.lower(), port)
            if key in seen:
                raise ClusterSpecError(
                    f"TF_CONFIG gives {job}:{i} the address {address!r}, already used by "
                    f"{seen[key]}; give every task its own host:port")
            seen[key] = f"{job}:{i}"
            parsed[job].append((host, port))
    chiefs = parsed.get(chief_key, [])
    if len(chiefs) > 1:
        raise ClusterSpecError(
            f"TF_CONFIG's cluster has {len(chiefs)} '{chief_key}' tasks; there can be only "
            f"one; list the others under 'worker'")
    return _TfCluster(chiefs=chiefs, workers=chiefs + parsed.get("worker", []),
                      ps=parsed.get("ps", []), evaluators=parsed.get("evaluator", []))


def _task(spec: dict) -> Tuple[str, int]:
    task = spec.get("task")
    if not isinstance(task, dict) or "type" not in task:
        raise ClusterSpecError(
            f"TF_CONFIG has no 'task' with a 'type' (got {task!r}); add "
            f'"task": {{"type": "worker", "index": 0}} saying which task this process is')
    task_type = str(task["type"]).strip().lower()
    if task_type not in TF_TASK_TYPES:
        raise ClusterSpecError(
            f"TF_CONFIG's task type {task['type']!r} is not supported by bps_tf; use one of "
            f"{', '.join(TF_TASK_TYPES)} (the scheduler runs inside ps:0)")
    index = task.get("index", 0)
    if isinstance(index, str) and index.strip().isdigit():
        index = int(index)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ClusterSpecError(
            f"TF_CONFIG's task index {task.get('index')!r} is not a non-negative integer; "
            f"set task.index to this task's position in its job's list")
    return task_type, index


def _check_index(index: int, job: list, name: str, required: bool = True) -> None:
    if not required:
        return
    if not job:
        raise ClusterSpecError(
            f"TF_CONFIG's task is {name}:{index}, but the cluster has no '{name}' job; "
            f"add this task's address to cluster.{name}")
    if index >= len(job):
        raise ClusterSpecError(
            f"TF_CONFIG's task index {index} is out of range: cluster.{name} has "
            f"{len(job)} task(s), so the index must be from 0 to {len(job) - 1}")


# ------------------------------------------------------------------ helpers

def _alone(role: str, source: str) -> ClusterConfig:
    """A process that trains (or evaluates) by itself: size 1, no servers."""
    return ClusterConfig(role=role, rank=0, num_workers=1, num_servers=0,
                         local_rank=0, local_size=1, source=source)


def _apply_local_overrides(cfg: ClusterConfig, environ: Mapping[str, str]) -> None:
    if environ.get("BYTEPS_LOCAL_SIZE", "").strip():
        cfg.local_size = _int_var(environ, "BYTEPS_LOCAL_SIZE", minimum=1,
                                  fix="set it to the number of workers on this host")
    if environ.get("BYTEPS_LOCAL_RANK", "").strip():
        cfg.local_rank = _int_var(environ, "BYTEPS_LOCAL_RANK", minimum=0,
                                  fix="set it to this worker's index among the workers on this host")
    if cfg.local_size > 0 and cfg.local_rank >= cfg.local_size:
        raise ClusterSpecError(
            f"BYTEPS_LOCAL_RANK={cfg.local_rank} is not below the local size "
            f"{cfg.local_size}; set BYTEPS_LOCAL_RANK from 0 to {cfg.local_size - 1} "
            f"(or set BYTEPS_LOCAL_SIZE to match)")


def _host_var(environ: Mapping[str, str], name: str) -> str:
    host = _strip_brackets(environ.get(name, "").strip())
    if not host:
        raise ClusterSpecError(f"{name} is not set; set it to the scheduler's host name or IP")
    return host


def _shorten(text: str) -> str:
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...")
