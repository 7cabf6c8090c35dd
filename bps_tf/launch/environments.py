"""What each process of a local job finds in its environment: what the job
shares (its size, its token, where the scheduler is), and what places one
server or worker in it.

No TensorFlow here (the launcher runs on server hosts).
"""
from __future__ import annotations

import secrets
from typing import Dict, Mapping

from bps_tf.launch import hosts as launch_hosts
from bps_tf.launch.output import PROG
from bps_tf.runtime import origins

LOCALHOST = "127.0.0.1"

# What horovodrun (Gloo) tells each worker, for scripts and tests that read
# their place from the environment; a local job is one host.
HOROVOD_PLACEMENT = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK",
                     "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")

# Variables that place a process in a cluster. A child gets only those the
# launcher sets for it, so a stale value in the caller's shell cannot leak in.
PLACEMENT_VARIABLES = (
    "TF_CONFIG", "DMLC_ROLE", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "DMLC_WORKER_ID",
    "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NODE_HOST", "BYTEPS_SERVER_ID",
    "BYTEPS_SERVER_PORT", "BYTEPS_BIND_HOST", "BYTEPS_HOST_SCHEDULER", "BYTEPS_READY_FILE",
    "BYTEPS_LOCAL_RANK", "BYTEPS_LOCAL_SIZE", "BYTEPS_LAUNCH_ID", "BYTEPS_ELASTIC_NEWCOMER",
    "HOROVOD_HOSTNAME", "HOROVOD_ELASTIC", origins.LAUNCHED_BY, *HOROVOD_PLACEMENT,
)


def clean_env(environ: Mapping[str, str]) -> Dict[str, str]:
    return {k: v for k, v in environ.items() if k not in PLACEMENT_VARIABLES}


def job_env(environ: Mapping[str, str], num_workers: int, num_servers: int,
            address: str = LOCALHOST) -> Dict[str, str]:
    """What every process of a local job shares; the scheduler and the
    servers listen on ``address`` (--address with --host-exec)."""
    env = clean_env(environ)
    # One token per job: the connections are encrypted with keys derived from
    # it, and processes of another job are refused.
    env.setdefault("BYTEPS_JOB_TOKEN", secrets.token_hex(16))
    # A process that dies by a fatal signal (SIGSEGV, SIGABRT...) prints every
    # thread's Python stack before it goes, so its crash says where it was.
    env.setdefault("PYTHONFAULTHANDLER", "1")
    env.update({
        "DMLC_NUM_WORKER": str(num_workers),
        "DMLC_NUM_SERVER": str(num_servers),
        origins.LAUNCHED_BY: f"{PROG} -np {num_workers} --servers {num_servers}",
        "DMLC_PS_ROOT_URI": address,
        "DMLC_NODE_HOST": address,
        "BYTEPS_BIND_HOST": address,
    })
    return env


def server_env(job_env: Mapping[str, str], server_id: int, scheduler_port: int,
               ready_file: str = "", health_port: int = 0) -> Dict[str, str]:
    env = dict(job_env)
    env.update({
        "DMLC_ROLE": "server",
        "BYTEPS_SERVER_ID": str(server_id),
        "BYTEPS_HOST_SCHEDULER": "1" if ready_file else "0",
        "DMLC_PS_ROOT_PORT": str(scheduler_port),
        "BYTEPS_SERVER_PORT": "0",
        # One port per server on this host: server i gets the base port + i.
        "BYTEPS_HEALTH_PORT": str(health_port + server_id if health_port else 0),
    })
    if ready_file:
        env["BYTEPS_READY_FILE"] = ready_file
    return env


def worker_env(job_env: Mapping[str, str], slot: launch_hosts.Slot,
               scheduler_port: int, remote: bool = False) -> Dict[str, str]:
    env = dict(job_env)
    env.update({
        "DMLC_ROLE": "worker",
        "DMLC_WORKER_ID": str(slot.rank),
        # bps_tf's own layout: one machine, whatever -H calls its hosts;
        # with --host-exec (remote), the hosts are machines of their own.
        "BYTEPS_LOCAL_RANK": str(slot.local_rank if remote else slot.rank),
        "BYTEPS_LOCAL_SIZE": str(slot.local_size if remote else slot.size),
        "DMLC_PS_ROOT_PORT": str(scheduler_port),
    })
    # horovodrun's: the host as -H lists it (localhost by default), and the
    # worker's place among that host's workers.
    env.update(horovod_env(slot))
    env.pop("BYTEPS_HEALTH_PORT", None)     # workers serve no health service
    if remote:
        place_on_host(env, slot.host)
    return env


def horovod_env(slot: launch_hosts.Slot) -> Dict[str, str]:
    """What horovodrun tells a worker about its place, as at its start."""
    return {"HOROVOD_HOSTNAME": slot.host, "HOROVOD_RANK": str(slot.rank),
            "HOROVOD_SIZE": str(slot.size), "HOROVOD_LOCAL_RANK": str(slot.local_rank),
            "HOROVOD_LOCAL_SIZE": str(slot.local_size), "HOROVOD_CROSS_RANK": str(slot.cross_rank),
            "HOROVOD_CROSS_SIZE": str(slot.cross_size)}


def place_on_host(env: Dict[str, str], host: str) -> None:
    """A worker on a host of its own (--host-exec) names that host as its
    address; it listens on nothing."""
    env["DMLC_NODE_HOST"] = host
    env.pop("BYTEPS_BIND_HOST", None)
