"""The pods Kubernetes would make from the manifests of examples/k8s/, without a cluster.

What each controller and the API server would do, as far as a pod's identity
and environment go, written from their documented behaviour (and, for JobSet
and Trainer v2, from their source at the versions tests/k8s_schemas/README.md
names):

* the API server's and the JobSet webhook's defaults (completionMode Indexed,
  DNS hostnames on, a replicated job's replicas 1, a Job's parallelism 1);
* the JobSet controller: Job ``<jobset>-<replicated job>-<job index>`` per
  replica, with the ``jobset.sigs.k8s.io/*`` labels and annotations on the Job
  and its pods, and the pods' subdomain (the JobSet's name unless set);
* Kubeflow Trainer v2: the JobSet it builds from a ClusterTrainingRuntime and a
  TrainJob (named as the TrainJob; numNodes pods in the trainer step, the
  TrainJob's image, command and env on its ``node`` container; the env of the
  TrainJob's runtimePatches on the containers they name);
* the Job controller: one pod per completion index with the
  ``batch.kubernetes.io/*`` labels and annotations, the hostname
  ``<job>-<index>`` and the ``JOB_COMPLETION_INDEX`` variable it adds to every
  container;
* the kubelet: a container's environment from its ``env`` (values with
  ``$(VAR)`` references, the downward API's ``fieldRef``, Secrets'
  ``secretKeyRef``), as the process sees it.

Anything a manifest uses that this module does not render raises
``NotImplementedError``, so a test never runs a pod whose environment was
guessed. Pod IPs are the caller's (tests give loopback addresses).
"""
import base64
import copy
import hashlib
import re

import yaml

JOBSET = ("jobset.x-k8s.io/v1alpha2", "JobSet")
TRAINJOB = ("trainer.kubeflow.org/v1alpha1", "TrainJob")
RUNTIME = ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime")
JOB = ("batch/v1", "Job")
TRAINER_ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"


def load(path):
    """The documents of a (multi-document) YAML manifest."""
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def find(docs, kind, name=None):
    found = [d for d in docs if (d["apiVersion"], d["kind"]) == kind
             and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} named {name} in the manifest, found {len(found)}"
    return found[0]


def secret_from_literal(name, **data):
    """The Secret `kubectl create secret generic NAME --from-literal=k=v ...` makes."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "type": "Opaque",
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


# ----------------------------------------------------------- controllers

def jobset_pods(jobset, namespace="default", parallelism=None):
    """The pods of a JobSet; ``parallelism`` {replicated job: n} scales one (ElasticJobSet)."""
    js = _jobset_defaults(jobset)
    name = js["metadata"]["name"]
    network = js["spec"]["network"]
    subdomain = network.get("subdomain") or name
    rjobs = js["spec"]["replicatedJobs"]
    total = sum(r["replicas"] for r in rjobs)
    pods, global_index = [], 0
    for rjob in rjobs:
        for job_index in range(rjob["replicas"]):
            job_name = f"{name}-{rjob['name']}-{job_index}"
            marks = {
                "jobset.sigs.k8s.io/jobset-name": name,
                "jobset.sigs.k8s.io/jobset-uid": "0" * 8,
                "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                "jobset.sigs.k8s.io/replicatedjob-replicas": str(rjob["replicas"]),
                "jobset.sigs.k8s.io/global-replicas": str(total),
                "jobset.sigs.k8s.io/job-index": str(job_index),
                "jobset.sigs.k8s.io/job-key": hashlib.sha1(
                    f"{namespace}/{job_name}".encode()).hexdigest(),
                "jobset.sigs.k8s.io/job-global-index": str(global_index),
                "jobset.sigs.k8s.io/restart-attempt": "0",
            }
            global_index += 1
            job = {"apiVersion": "batch/v1", "kind": "Job",
                   "metadata": {"name": job_name, "namespace": namespace,
                                "labels": dict(marks), "annotations": dict(marks)},
                   "spec": copy.deepcopy(rjob["template"]["spec"])}
            template = job["spec"]["template"]
            meta = template.setdefault("metadata", {})
            meta["labels"] = {**meta.get("labels", {}), **marks}
            meta["annotations"] = {**meta.get("annotations", {}), **marks}
            if network["enableDNSHostnames"]:
                template["spec"]["subdomain"] = subdomain
            if parallelism and rjob["name"] in parallelism:
                job["spec"]["parallelism"] = job["spec"]["completions"] = parallelism[rjob["name"]]
            pods += indexed_job_pods(job, namespace)
    return pods


def indexed_job_pods(job, namespace="default", completions=None):
    """The pods of an Indexed Job; ``completions`` scales it (an elastic Indexed Job)."""
    spec = copy.deepcopy(job["spec"])
    if spec.get("completionMode") != "Indexed":
        raise NotImplementedError(f"Job {job['metadata']['name']}: only Indexed Jobs are rendered")
    if completions is not None:
        spec["completions"] = spec["parallelism"] = completions
    count = min(spec["completions"], spec.get("parallelism", 1))
    name = job["metadata"]["name"]
    pods = []
    for index in range(count):
        template = copy.deepcopy(spec["template"])
        meta = template.get("metadata", {})
        marks = {"batch.kubernetes.io/job-name": name, "job-name": name,
                 "batch.kubernetes.io/controller-uid": "1" * 8, "controller-uid": "1" * 8,
                 "batch.kubernetes.io/job-completion-index": str(index)}
        pod_spec = template["spec"]
        pod_spec.setdefault("hostname", f"{name}-{index}")
        for container in pod_spec.get("initContainers", []) + pod_spec["containers"]:
            env = container.setdefault("env", [])
            if not any(e["name"] == "JOB_COMPLETION_INDEX" for e in env):
                env.append({"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
                    "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}})
        pods.append({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": f"{name}-{index}-{hashlib.sha1(f'{name}{index}'.encode()).hexdigest()[:5]}",
            "namespace": namespace,
            "labels": {**meta.get("labels", {}), **marks},
            "annotations": {**meta.get("annotations", {}),
                            "batch.kubernetes.io/job-completion-index": str(index)}},
            "spec": pod_spec, "status": {}})
    return pods


def trainjob_jobset(runtime, trainjob):
    """The JobSet Kubeflow Trainer v2 builds for a TrainJob of a ClusterTrainingRuntime."""
    ref = trainjob["spec"]["runtimeRef"]
    assert (ref.get("kind", "ClusterTrainingRuntime"), ref["name"]) == (
        "ClusterTrainingRuntime", runtime["metadata"]["name"]), "the TrainJob names another runtime"
    policy = runtime["spec"].get("mlPolicy", {})
    if set(policy) - {"numNodes"}:
        raise NotImplementedError(f"mlPolicy {sorted(policy)}: only the plain policy is rendered")
    trainer = trainjob["spec"].get("trainer", {})
    if set(trainer) - {"numNodes", "image", "command", "args", "env"}:
        raise NotImplementedError(f"TrainJob trainer fields {sorted(trainer)}")
    spec = copy.deepcopy(runtime["spec"]["template"]["spec"])
    nodes = trainer.get("numNodes", policy.get("numNodes", 1))
    for rjob in spec["replicatedJobs"]:
        labels = rjob["template"].get("metadata", {}).get("labels", {})
        if labels.get(TRAINER_ANCESTOR) != "trainer":
            continue
        rjob["replicas"] = 1
        rjob["template"]["spec"]["parallelism"] = rjob["template"]["spec"]["completions"] = nodes
        for container in rjob["template"]["spec"]["template"]["spec"]["containers"]:
            if container["name"] == "node":
                for field in ("image", "command", "args"):
                    if field in trainer:
                        container[field] = list(trainer[field]) if field != "image" else trainer[field]
                _upsert_env(container, trainer.get("env", []))
    for patch in trainjob["spec"].get("runtimePatches", []):
        _apply_runtime_patch(spec, patch)
    return {"apiVersion": JOBSET[0], "kind": JOBSET[1],
            "metadata": {"name": trainjob["metadata"]["name"]}, "spec": spec}


def _apply_runtime_patch(spec, patch):
    template = patch.get("trainingRuntimeSpec", {}).get("template", {})
    if set(template) - {"spec"} or set(template.get("spec", {})) - {"replicatedJobs"}:
        raise NotImplementedError(f"runtime patch fields {sorted(template)}")
    by_name = {r["name"]: r for r in spec["replicatedJobs"]}
    for rpatch in template["spec"]["replicatedJobs"]:
        pod = rpatch["template"]["spec"]["template"]["spec"]
        if set(pod) - {"containers"}:
            raise NotImplementedError(f"runtime patch pod fields {sorted(pod)}")
        containers = {c["name"]: c for c in
                      by_name[rpatch["name"]]["template"]["spec"]["template"]["spec"]["containers"]}
        for cpatch in pod["containers"]:
            if set(cpatch) - {"name", "env"}:
                raise NotImplementedError(f"runtime patch container fields {sorted(cpatch)}")
            _upsert_env(containers[cpatch["name"]], cpatch.get("env", []))


def _upsert_env(container, env):
    current = container.setdefault("env", [])
    for var in env:
        names = [e["name"] for e in current]
        if var["name"] in names:
            current[names.index(var["name"])] = copy.deepcopy(var)
        else:
            current.append(copy.deepcopy(var))


def _jobset_defaults(jobset):
    js = copy.deepcopy(jobset)
    spec = js["spec"]
    network = spec.setdefault("network", {})
    network.setdefault("enableDNSHostnames", True)
    network.setdefault("publishNotReadyAddresses", True)
    for rjob in spec["replicatedJobs"]:
        rjob.setdefault("replicas", 1)
        job = rjob["template"]["spec"]
        job.setdefault("completionMode", "Indexed")
        job.setdefault("parallelism", 1)
        job.setdefault("completions", job["parallelism"])
        job["template"]["spec"].setdefault("restartPolicy", "OnFailure")
    return js


# ---------------------------------------------------------------- kubelet

_FIELD = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")


def container_env(pod, container_name, secrets=()):
    """name -> value of a container's variables, as its process sees them."""
    pod_spec = pod["spec"]
    container = next(c for c in pod_spec["containers"] if c["name"] == container_name)
    if container.get("envFrom"):
        raise NotImplementedError("envFrom")
    by_name = {s["metadata"]["name"]: s for s in secrets}
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(var["value"], env)
            continue
        source = var.get("valueFrom", {})
        if "fieldRef" in source:
            env[var["name"]] = _field(pod, source["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            secret = by_name.get(ref["name"])
            if secret is None or ref["key"] not in secret["data"]:
                # The kubelet would not start the container (CreateContainerConfigError).
                raise LookupError(f"{var['name']}: Secret {ref['name']!r} key {ref['key']!r} "
                                  f"does not exist")
            env[var["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
        else:
            raise NotImplementedError(f"{var['name']}: valueFrom {sorted(source)}")
    return env


def _field(pod, path):
    match = _FIELD.fullmatch(path)
    if match:
        return pod["metadata"].get(match.group(1), {}).get(match.group(2), "")
    simple = {"metadata.name": pod["metadata"]["name"],
              "metadata.namespace": pod["metadata"]["namespace"],
              "status.podIP": pod["status"].get("podIP", ""),
              "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default")}
    if path not in simple:
        raise NotImplementedError(f"fieldRef {path}")
    return simple[path]


def _expand(value, env):
    # $(VAR) names a variable defined earlier in the list; $$ escapes; an
    # unknown reference stays as written (the kubelet's rules).
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


def dns_name(pod):
    """The pod's stable name, <hostname>.<subdomain>, or None without a subdomain."""
    spec = pod["spec"]
    return f"{spec['hostname']}.{spec['subdomain']}" if spec.get("subdomain") else None
