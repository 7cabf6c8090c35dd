"""What each process of a local job finds in its environment: what the job
shares (its size, its token, where the scheduler is), and what places one
server or worker in it.

No TensorFlow here (the launcher runs on server hosts).
"""
from __future__ import annotations

import secrets
from typing import Dict, Mapping

from bps_tf.launch import elastic as elastic_launch
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


def job_env(environ: Mapping[str, str], num_workers: int, num_servers: int) -> Dict[str, str]:
    """What every process of a local job shares."""
    env = clean_env(environ)
    # One token per job: the connections are encrypted with keys derived from
    # it, and processes of another job are refused.
    env.setdefault("BYTEPS_JOB_TOKEN", secrets.token_hex(16))
    env.update({
        "DMLC_NUM_WORKER": str(num_workers),
        "DMLC_NUM_SERVER": str(num_servers),
        origins.LAUNCHED_BY: f"{PROG} -np {num_workers} --servers {num_servers}",
        "DMLC_PS_ROOT_URI": LOCALHOST,
        "DMLC_NODE_HOST": LOCALHOST,
        "BYTEPS_BIND_HOST": LOCALHOST,
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
                scheduler_port: int) -> Dict[str, str]:
    env = dict(job_env)
    env.update({
        "DMLC_ROLE": "worker",
        "DMLC_WORKER_ID": str(slot.rank),
        # bps_tf's own layout: one machine, whatever -H calls its hosts.
        "BYTEPS_LOCAL_RANK": str(slot.rank),
        "BYTEPS_LOCAL_SIZE": str(slot.size),
        "DMLC_PS_ROOT_PORT": str(scheduler_port),
    })
    # horovodrun's: the host as -H lists it (localhost by default), and the
    # worker's place among that host's workers.
    env.update(elastic_launch.horovod_env(slot))
    env.pop("BYTEPS_HEALTH_PORT", None)     # workers serve no health service
    return env
