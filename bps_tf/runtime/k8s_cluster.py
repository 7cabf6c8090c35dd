"""Where this process sits in a bps_tf job, from what a Kubernetes pod sees.

The third source of ``bps_tf.runtime.cluster.resolve`` (after ``DMLC_*`` and
``TF_CONFIG``): a pod of a JobSet (``jobset.x-k8s.io``, which Kubeflow Trainer
v2 builds on) or of a plain Indexed Job behind a headless Service learns its
place from Kubernetes itself, so no one writes a TF_CONFIG:

* its index: ``JOB_COMPLETION_INDEX``, which Kubernetes sets in every pod of
  an Indexed Job (a JobSet's Jobs are Indexed Jobs), plus, in a JobSet, the
  index of its Job in its replicated job (``JOB_INDEX``, from the label
  ``jobset.sigs.k8s.io/job-index``);
* its role: the replicated job's name (``REPLICATED_JOB_NAME``, from the label
  ``jobset.sigs.k8s.io/replicatedjob-name``): ``server`` holds the servers,
  ``worker`` (or ``node``, Trainer v2's trainer step) the workers; in a plain
  Indexed Job, the Job's name (``JOB_NAME``, from the label
  ``batch.kubernetes.io/job-name``), which ends in ``-server`` or ``-worker``;
* the stable DNS names of the pods: JobSet names them
  ``<jobset>-<replicated job>-<job index>-<pod index>.<subdomain>`` (the
  subdomain is the JobSet's name unless set otherwise); an Indexed Job with a
  ``subdomain`` names them ``<job>-<index>.<service>``, and bps_tf's manifests
  name the Jobs ``<name>-server`` / ``<name>-worker`` and the Service
  ``<name>``. Server 0 hosts the scheduler, so everyone finds it by its name.

What Kubernetes does not tell a pod comes from BytePS' own variables: the
sizes (``DMLC_NUM_WORKER``, ``DMLC_NUM_SERVER``, required), and, to override
the derived addresses, ``DMLC_PS_ROOT_URI`` / ``DMLC_PS_ROOT_PORT`` (default
2222) / ``DMLC_NODE_HOST``. The variables holding labels are set in the
manifests through the downward API (examples/k8s/). A pod that sets some of
them but not all, or whose values disagree, stops with a ``ClusterSpecError``
that names the variable and the fix (docs/launcher.md has the table).

``BYTEPS_K8S_TEST_HOSTS`` is for tests only: it maps pod DNS names to
loopback addresses, so a job "rendered" from the manifests runs on one machine
(tests/test_k8s_jobs.py). It refuses any other address, so it cannot send
production traffic anywhere but to this machine.

No TensorFlow here.
"""
from __future__ import annotations

import os
from typing import Dict, Mapping, Optional, Tuple

from bps_tf.runtime import placement
from bps_tf.runtime.placement import ClusterConfig, ClusterSpecError

DEFAULT_PORT = 2222                    # TFJob's default port, and the manifests'
SERVER_JOBS = ("server",)
WORKER_JOBS = ("worker", "node")       # node: Kubeflow Trainer v2's trainer step
TEST_HOSTS = "BYTEPS_K8S_TEST_HOSTS"
# Set with a Kubernetes source they would be ignored, so they are refused.
_PLACEMENT_ONLY_IN_DMLC = ("DMLC_WORKER_ID", "BYTEPS_SERVER_ID", "BYTEPS_HOST_SCHEDULER")


def configured(environ: Mapping[str, str]) -> bool:
    """Whether the pod describes a bps_tf job through Kubernetes' variables."""
    if _get(environ, "JOBSET_NAME") or _get(environ, "REPLICATED_JOB_NAME"):
        return True
    return bool(_get(environ, "JOB_NAME") and _get(environ, "JOB_COMPLETION_INDEX"))


def resolve(environ: Mapping[str, str]) -> ClusterConfig:
    """This pod's place, from the JobSet or Indexed Job variables."""
    for name in _PLACEMENT_ONLY_IN_DMLC:
        if _get(environ, name):
            raise ClusterSpecError(
                f"{name} is set, but this pod takes its place from Kubernetes "
                f"(JOB_COMPLETION_INDEX and the job's name); unset {name}, or set DMLC_ROLE "
                f"to describe the pod with DMLC_* variables alone")
    if _get(environ, "JOBSET_NAME") or _get(environ, "REPLICATED_JOB_NAME"):
        role, index, own, server0, form = _jobset_place(environ)
    else:
        role, index, own, server0, form = _indexed_job_place(environ)
    num_workers = _count(environ, "DMLC_NUM_WORKER", "workers", form)
    num_servers = _count(environ, "DMLC_NUM_SERVER", "servers", form)
    port = placement.int_var(environ, "DMLC_PS_ROOT_PORT", default=DEFAULT_PORT, minimum=1,
                             maximum=65535, fix="set it to the servers' port (the "
                             "containerPort of the server pods), or unset it for 2222")
    hosts = host_overrides(environ)
    scheduler = _get(environ, "DMLC_PS_ROOT_URI") or server0
    advertise = _get(environ, "DMLC_NODE_HOST") or own
    scheduler, advertise = hosts.get(scheduler, scheduler), hosts.get(advertise, advertise)
    cfg = ClusterConfig(
        role=role, num_workers=num_workers, num_servers=num_servers,
        scheduler_host=scheduler, scheduler_port=port, advertise_host=advertise,
        bind_host=placement.choose_bind_host(environ, [scheduler, advertise], advertise),
        ready_file=_get(environ, "BYTEPS_READY_FILE"),
        # The pod's host name: each pod is a host of its own (its own network).
        hostname=own.split(".", 1)[0], source="Kubernetes")
    if role == "server":
        if index >= num_servers:
            raise ClusterSpecError(
                f"this server pod has index {index} ({form}), but DMLC_NUM_SERVER={num_servers}: "
                f"the servers are fixed; make DMLC_NUM_SERVER equal to the server pods' count")
        cfg.server_id, cfg.port, cfg.host_scheduler = index, port, index == 0
    elif index < num_workers:
        cfg.rank = index
    elif _elastic(environ):
        cfg.rank = -1   # a pod added while the job runs: joins at the next membership epoch
    else:
        raise ClusterSpecError(
            f"this worker pod has index {index} ({form}), but DMLC_NUM_WORKER={num_workers}; "
            f"make DMLC_NUM_WORKER the worker pods' count, or set BYTEPS_ELASTIC=1 so that "
            f"pods beyond it join the running job as newcomers")
    return cfg


def host_overrides(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """BYTEPS_K8S_TEST_HOSTS, "name=127.0.0.x,...": pod names -> loopback addresses (tests only)."""
    text = _get(os.environ if environ is None else environ, TEST_HOSTS)
    table: Dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, address = item.partition("=")
        address = address.strip()
        if not sep or not name.strip() or not placement.is_loopback(address):
            raise ClusterSpecError(
                f"{TEST_HOSTS} has {item!r}: it is for tests only and maps a pod's name to a "
                f"loopback address (name=127.0.0.x or name=::1); unset it outside tests")
        table[name.strip()] = address
    return table


# ------------------------------------------------------------------ forms

def _jobset_place(environ: Mapping[str, str]) -> Tuple[str, int, str, str, str]:
    jobset = _label(environ, "JOBSET_NAME", "jobset.sigs.k8s.io/jobset-name")
    rjob = _label(environ, "REPLICATED_JOB_NAME", "jobset.sigs.k8s.io/replicatedjob-name")
    job_index = _index(environ, "JOB_INDEX", "the label jobset.sigs.k8s.io/job-index "
                                             "through the downward API")
    pod_index = _index(environ, "JOB_COMPLETION_INDEX", _COMPLETION_FIX)
    role = _role(rjob, f"REPLICATED_JOB_NAME={rjob!r}")
    if job_index and pod_index:
        raise ClusterSpecError(
            f"pod {pod_index} of Job {job_index} of replicated job {rjob!r}: bps_tf numbers "
            f"the pods of a replicated job either by Job (replicas: N, parallelism: 1) or by "
            f"pod (replicas: 1, parallelism and completions N), not both; change the JobSet "
            f"to one of the two")
    own = f"{jobset}-{rjob}-{job_index}-{pod_index}.{jobset}"
    form = f"JOB_INDEX={job_index}, JOB_COMPLETION_INDEX={pod_index}"
    return role, job_index + pod_index, own, f"{jobset}-server-0-0.{jobset}", form


def _indexed_job_place(environ: Mapping[str, str]) -> Tuple[str, int, str, str, str]:
    job = _label(environ, "JOB_NAME", "batch.kubernetes.io/job-name")
    index = _index(environ, "JOB_COMPLETION_INDEX", _COMPLETION_FIX)
    prefix, _, kind = job.rpartition("-")
    if not prefix:
        raise ClusterSpecError(
            f"JOB_NAME={job!r}: bps_tf finds a plain Indexed Job's role in its name; name "
            f"the Jobs <name>-server and <name>-worker, with a headless Service <name>")
    role = _role(kind, f"JOB_NAME={job!r} (its last part, {kind!r})")
    return (role, index, f"{job}-{index}.{prefix}", f"{prefix}-server-0.{prefix}",
            f"JOB_COMPLETION_INDEX={index}")


_COMPLETION_FIX = ("Kubernetes sets it in every pod of an Indexed Job: give the Job "
                   "completionMode: Indexed")


def _role(name: str, where: str) -> str:
    if name in SERVER_JOBS:
        return "server"
    if name in WORKER_JOBS:
        return "worker"
    raise ClusterSpecError(
        f"{where} names no bps_tf role: the servers' job must be called "
        f"{' or '.join(SERVER_JOBS)} and the workers' {' or '.join(WORKER_JOBS)}")


# ---------------------------------------------------------------- helpers

def _get(environ: Mapping[str, str], name: str) -> str:
    return environ.get(name, "").strip()


def _label(environ: Mapping[str, str], name: str, label: str) -> str:
    value = _get(environ, name)
    if not value:
        raise ClusterSpecError(
            f"{name} is not set, but other Kubernetes variables are: set it from the pod's "
            f"label {label} through the downward API (env: - name: {name}, valueFrom: "
            f"fieldRef: fieldPath: metadata.labels['{label}']); see docs/kubernetes.md")
    return value


def _index(environ: Mapping[str, str], name: str, fix: str) -> int:
    return placement.int_var(environ, name, minimum=0, fix=fix)


def _count(environ: Mapping[str, str], name: str, what: str, form: str) -> int:
    if not _get(environ, name):
        raise ClusterSpecError(
            f"{name} is not set: Kubernetes does not tell a pod how many {what} its job has "
            f"(this pod: {form}); set {name} to that number in every pod's env")
    return placement.int_var(environ, name, minimum=1, fix=f"set it to the number of {what}")


def _elastic(environ: Mapping[str, str]) -> bool:
    return placement.flag_var(environ, "BYTEPS_ELASTIC")


__all__ = ["configured", "resolve", "host_overrides", "DEFAULT_PORT", "TEST_HOSTS"]
