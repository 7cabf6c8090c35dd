"""`BytePSStrategy.cluster_resolver`: where this process sits, in TensorFlow's terms.

TensorFlow's multi-worker tutorials read ``strategy.cluster_resolver.task_type``
and ``.task_id`` (e.g. to let only the chief write checkpoints) and
``.cluster_spec()``. bps_tf answers the same questions from the same source
that placed the process in the job (``bps_tf.runtime.cluster.resolve``):

* TF_CONFIG: its own ``cluster`` and ``task``, as TensorFlow would report them
  (``chief``/``worker``/``ps``/``evaluator`` with TF_CONFIG's indexes).
* BytePS ``DMLC_*`` variables (``bpslaunch`` sets them), or a Kubernetes
  pod's JobSet / Indexed Job variables: task type ``worker``
  (or ``ps`` for a server) with the worker rank (server id) as the index. The
  other tasks' addresses are not known to this process, so the cluster spec
  holds this task alone (a sparse ClusterSpec), plus the scheduler's address
  as ``ps`` task 0 where it is known.
* No cluster: ``worker`` 0 of one, as TensorFlow's single-worker strategies.
"""
from __future__ import annotations

import json
import os
from typing import Mapping, Optional

import tensorflow as tf

from bps_tf.runtime import cluster

__all__ = ["make_cluster_resolver"]


def make_cluster_resolver(environ: Optional[Mapping[str, str]] = None):
    """A ``tf.distribute.cluster_resolver.ClusterResolver`` for this process."""
    cfg = cluster.resolve(environ)
    if cfg.source == "TF_CONFIG":
        return _from_tf_config((os.environ if environ is None else environ)["TF_CONFIG"])
    if cfg.source in ("DMLC", "Kubernetes"):
        is_worker = cfg.role == "worker"
        task_type = "worker" if is_worker else "ps"
        task_id = max(cfg.rank if is_worker else cfg.server_id, 0)   # newcomer: -1
        jobs = {task_type: {task_id: cluster.join_host_port(cfg.advertise_host or cfg.hostname, 0)}}
        if cfg.scheduler_host and cfg.scheduler_port and (is_worker or task_id != 0):
            jobs.setdefault("ps", {})[0] = cluster.join_host_port(cfg.scheduler_host,
                                                                  cfg.scheduler_port)
        return _simple(jobs, task_type, task_id)
    return _simple({"worker": {0: "localhost:0"}}, "worker", 0)


def _from_tf_config(text: str):
    spec = json.loads(text)  # cluster.resolve() has already validated it
    task = spec.get("task") or {}
    jobs = {job: list(tasks) if isinstance(tasks, list) else dict(tasks)
            for job, tasks in spec.get("cluster", {}).items()}
    return _simple(jobs, task.get("type", "worker"), int(task.get("index", 0)),
                   rpc_layer=spec.get("rpc_layer"))


def _simple(jobs, task_type: str, task_id: int, rpc_layer=None):
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(jobs), task_type=task_type, task_id=task_id,
        rpc_layer=rpc_layer)
