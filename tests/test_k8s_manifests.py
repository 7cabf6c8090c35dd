"""examples/k8s/ without a cluster: every manifest is valid, and every pod it makes finds its place.

* Validity: Kubernetes' own kinds (and every pod template inside the custom
  resources, as the Job it becomes) against the Kubernetes API schemas of
  ``kubernetes-validate``, strictly (unknown fields are errors, as with
  ``kubectl apply``); JobSet, Trainer v2 and TFJob against their CRD schemas,
  vendored in tests/k8s_schemas/. Deliberately broken copies must fail.
* Placement: tests/k8s_render.py makes each manifest's pods as the
  controllers would (names, labels, env through the downward API, the token
  from a Secret as ``kubectl create secret`` makes it), and
  ``bps_tf.runtime.cluster.resolve`` must give every pod its role, rank and
  the scheduler's stable name, from exactly that environment.
* Half-configured pods stop with an error naming the variable; the precedence
  of DMLC_*, TF_CONFIG and Kubernetes; the DNS discovery helper.

The jobs themselves run in tests/test_k8s_jobs.py. No cluster, kubectl or network.
"""
import copy
import json
import os
import sys

import jsonschema
import kubernetes_validate
import pytest
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k8s_render as render  # noqa: E402

from bps_tf.launch import k8s_discovery, launcher  # noqa: E402
from bps_tf.runtime import cluster, k8s_cluster  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "k8s")
SCHEMAS = os.path.join(ROOT, "tests", "k8s_schemas")
MANIFESTS = ("jobset.yaml", "jobset-gpu.yaml", "indexed-job-elastic.yaml", "trainer-v2.yaml",
             "tfjob.yaml")
# The oldest Kubernetes the docs ask for (elastic Indexed Jobs and podFailurePolicy are GA):
# a field added since would be refused, as that cluster would refuse it.
K8S_VERSION = "1.31"
TOKEN = "k8s-test-token-0123456789abcdef"
COMMAND = ["bpslaunch", "python", "examples/keras_digits.py"]


# ------------------------------------------------------------ validation

def _strict(schema):
    """The schema with unknown fields refused (kubectl's strict field validation)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) if k != "properties" else {f: _strict(s) for f, s in v.items()}
                  for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(s) for s in schema]
    return schema


def _crd_validators():
    validators = {}
    for name in os.listdir(SCHEMAS):
        if name.endswith(".json"):
            with open(os.path.join(SCHEMAS, name)) as f:
                crd = json.load(f)
            key = (f"{crd['group']}/{crd['version']}", crd["kind"])
            validators[key] = jsonschema.Draft7Validator(_strict(crd["openAPIV3Schema"]))
    return validators


CRDS = _crd_validators()


def _pod_templates(doc):
    """(where, Job spec) of every pod template in a custom resource."""
    kind = (doc["apiVersion"], doc["kind"])
    if kind == render.JOBSET:
        return [(f"replicatedJobs[{r['name']}]", r["template"]["spec"])
                for r in doc["spec"]["replicatedJobs"]]
    if kind == render.RUNTIME:
        return [(f"replicatedJobs[{r['name']}]", r["template"]["spec"])
                for r in doc["spec"]["template"]["spec"]["replicatedJobs"]]
    if kind == ("kubeflow.org/v1", "TFJob"):
        return [(f"tfReplicaSpecs[{n}]", {"template": s["template"]})
                for n, s in doc["spec"]["tfReplicaSpecs"].items()]
    return []


def problems(doc):
    """Every schema violation of one manifest document, as 'where: what' lines."""
    kind = (doc["apiVersion"], doc["kind"])
    name = doc["metadata"]["name"]
    found = []
    if kind in CRDS:
        found += [f"{kind[1]} {name} {'/'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in CRDS[kind].iter_errors(doc)]
        checked = [(where, {"apiVersion": "batch/v1", "kind": "Job",
                            "metadata": {"name": "template"}, "spec": spec})
                   for where, spec in _pod_templates(doc)]
    else:
        checked = [("", doc)]
    for where, resource in checked:
        try:
            kubernetes_validate.validate(resource, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(map(str, exc.path))
            found.append(f"{kind[1]} {name} {where} {path} (Kubernetes {K8S_VERSION}): "
                         f"{exc.message}")
        except kubernetes_validate.SchemaNotFoundError:
            found.append(f"{kind[1]} {name}: no schema for {kind} (a typo in apiVersion/kind?)")
    return found


def _docs(name):
    return render.load(os.path.join(EXAMPLES, name))


def test_every_example_is_listed():
    assert sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".yaml")) == sorted(MANIFESTS)


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_validates_against_the_schemas(name):
    docs = _docs(name)
    assert docs
    for doc in docs:
        assert problems(doc) == [], name


@pytest.mark.parametrize("name,good,bad,expect", [
    # A string where the API wants a number: the JobSet's pod template, as its Job.
    ("jobset.yaml", "parallelism: 2", "parallelism: two", "'two' is not of type 'integer'"),
    # A misspelt field (strict validation), in a plain Job.
    ("indexed-job-elastic.yaml", "terminationGracePeriodSeconds: 120",
     "terminationGracePeriodSecond: 120", "terminationGracePeriodSecond"),
    # The JobSet type itself: a field of its spec that does not exist.
    ("jobset.yaml", "  startupPolicy:\n", "  startupPolicyy:\n", "startupPolicyy"),
    # Trainer v2's types: numNodes is an integer.
    ("trainer-v2.yaml", "    numNodes: 2\n    image", "    numNodes: two\n    image",
     "'two' is not of type 'integer'"),
])
def test_a_broken_copy_fails_validation(name, good, bad, expect):
    with open(os.path.join(EXAMPLES, name)) as f:
        text = f.read()
    assert good in text, good
    originals = list(yaml.safe_load_all(text))
    changed = [d for d in yaml.safe_load_all(text.replace(good, bad, 1)) if d not in originals]
    assert len(changed) == 1
    found = problems(changed[0])
    assert found and any(expect in p for p in found), found


def test_tfjob_is_marked_for_trainer_v1():
    with open(os.path.join(EXAMPLES, "tfjob.yaml")) as f:
        head = f.read(600)
    assert "Trainer v1" in head and "unmaintained" in head


# ------------------------------------------------------------- placement

def _secret(name):
    return render.secret_from_literal(name, token=TOKEN)


def _placed(pods, secret_name, container=None):
    """pod -> (its env, its ClusterConfig), every pod resolved from its rendered env."""
    placed = []
    for pod in pods:
        name = container or pod["spec"]["containers"][0]["name"]
        env = render.container_env(pod, name, [_secret(secret_name)])
        placed.append((pod, env, cluster.resolve(env)))
    return placed


def _check_job(placed, servers, workers, command=COMMAND):
    """Roles, ranks, sizes, the scheduler's and each pod's names, token and probes."""
    server0 = [p for p, _, c in placed if c.role == "server" and c.server_id == 0]
    assert len(server0) == 1
    scheduler = render.dns_name(server0[0])
    ranks, ids = [], []
    for pod, env, cfg in placed:
        container = pod["spec"]["containers"][0]
        where = pod["metadata"]["name"]
        assert cfg.source == "Kubernetes", where
        assert (cfg.num_workers, cfg.num_servers) == (workers, servers), where
        assert (cfg.scheduler_host, cfg.scheduler_port) == (scheduler, k8s_cluster.DEFAULT_PORT)
        assert cfg.advertise_host == render.dns_name(pod), where
        assert cfg.hostname == pod["spec"]["hostname"], where
        assert env["BYTEPS_JOB_TOKEN"] == TOKEN, where
        assert len(pod["spec"]["hostname"]) <= 63, where
        assert pod["spec"]["terminationGracePeriodSeconds"] >= 30, where
        assert container["resources"]["requests"], where
        if cfg.role == "server":
            ids.append(cfg.server_id)
            assert cfg.host_scheduler == (cfg.server_id == 0) and cfg.bind_host == "0.0.0.0"
            assert {"name": "bps", "containerPort": cfg.port} in container["ports"], where
            port = int(env["BYTEPS_HEALTH_PORT"])
            assert {"name": "health", "containerPort": port} in container["ports"], where
            for probe in ("readinessProbe", "livenessProbe"):
                # Not "": readiness must not wait for the cluster to meet.
                assert container[probe]["grpc"] == {"port": port, "service": "bps_tf.live"}
        else:
            ranks.append(cfg.rank)
            assert "BYTEPS_HEALTH_PORT" not in env and "readinessProbe" not in container
            assert container["command"] == command, where
    assert sorted(ids) == list(range(servers)) and sorted(ranks) == list(range(workers))


def test_jobset_pods_find_their_place():
    js = render.find(_docs("jobset.yaml"), render.JOBSET)
    pods = render.jobset_pods(js)
    assert [p["spec"]["hostname"] for p in pods] == [
        "bps-tf-jobset-server-0-0", "bps-tf-jobset-server-0-1",
        "bps-tf-jobset-worker-0-0", "bps-tf-jobset-worker-0-1"]
    placed = _placed(pods, "bps-tf-jobset-token")
    _check_job(placed, servers=2, workers=2)
    assert placed[0][2].scheduler_host == "bps-tf-jobset-server-0-0.bps-tf-jobset"
    # Servers first (their readiness starts the workers), and a PDB over every pod.
    assert js["spec"]["startupPolicy"] == {"startupPolicyOrder": "InOrder"}
    assert [r["name"] for r in js["spec"]["replicatedJobs"]] == ["server", "worker"]
    pdb = render.find(_docs("jobset.yaml"), ("policy/v1", "PodDisruptionBudget"))
    assert all(_selects(pdb["spec"]["selector"], p) for p in pods)


def test_gpu_workers_take_the_gpus_and_the_servers_none():
    js = render.find(_docs("jobset-gpu.yaml"), render.JOBSET)
    placed = _placed(render.jobset_pods(js), "bps-tf-jobset-gpu-token")
    _check_job(placed, servers=2, workers=2)
    for pod, _, cfg in placed:
        limits = pod["spec"]["containers"][0]["resources"].get("limits", {})
        assert (limits.get("nvidia.com/gpu", 0) > 0) == (cfg.role == "worker")


def _selects(selector, pod):
    return all(pod["metadata"]["labels"].get(k) == v for k, v in selector["matchLabels"].items())


def test_indexed_job_pods_find_their_place_and_scale():
    docs = _docs("indexed-job-elastic.yaml")
    service = render.find(docs, ("v1", "Service"))
    servers = render.find(docs, render.JOB, "bps-tf-elastic-server")
    workers = render.find(docs, render.JOB, "bps-tf-elastic-worker")
    pods = render.indexed_job_pods(servers) + render.indexed_job_pods(workers)
    # The headless Service publishes every pod under its name, ready or not.
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    for pod in pods:
        assert pod["spec"]["subdomain"] == service["metadata"]["name"]
        assert _selects({"matchLabels": service["spec"]["selector"]}, pod)
    placed = _placed(pods, "bps-tf-elastic-token")
    _check_job(placed, servers=2, workers=2)
    assert placed[0][2].scheduler_host == "bps-tf-elastic-server-0.bps-tf-elastic"
    assert all(env["BYTEPS_ELASTIC"] == "1" for _, env, _ in placed)
    # Scaled up to 3: the new pod is a newcomer; elastic or not, the count must agree.
    third = render.indexed_job_pods(workers, completions=3)[2]
    _, env, cfg = _placed([third], "bps-tf-elastic-token")[0]
    assert (cfg.role, cfg.rank, third["spec"]["hostname"]) == ("worker", -1,
                                                              "bps-tf-elastic-worker-2")
    assert "newcomer" in cluster.describe(cfg)
    env["BYTEPS_ELASTIC"] = "0"
    with pytest.raises(cluster.ClusterSpecError, match="index 2 .*DMLC_NUM_WORKER=2"):
        cluster.resolve(env)
    # Evictions are replaced without counting; the servers stay through drains.
    rules = workers["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [
        {"type": "DisruptionTarget", "status": "True"}]} in rules
    pdb = render.find(docs, ("policy/v1", "PodDisruptionBudget"))
    assert [_selects(pdb["spec"]["selector"], p) for p in pods] == [True, True, False, False]


def test_trainer_v2_pods_find_their_place():
    docs = _docs("trainer-v2.yaml")
    runtime, trainjob = render.find(docs, render.RUNTIME), render.find(docs, render.TRAINJOB)
    js = render.trainjob_jobset(runtime, trainjob)
    pods = render.jobset_pods(js)
    assert [p["spec"]["hostname"] for p in pods] == [
        "bps-tf-trainjob-server-0-0", "bps-tf-trainjob-server-0-1",
        "bps-tf-trainjob-node-0-0", "bps-tf-trainjob-node-0-1"]
    placed = _placed(pods, "bps-tf-trainjob-token")
    _check_job(placed, servers=2, workers=2)
    # numNodes is said three times (Kubernetes tells the pods none): they must agree.
    nodes = trainjob["spec"]["trainer"]["numNodes"]
    assert all(cfg.num_workers == nodes for _, _, cfg in placed)
    # A TrainJob of another size: patched the same way, every pod follows.
    bigger = copy.deepcopy(trainjob)
    bigger["spec"]["trainer"]["numNodes"] = 3
    for env in [bigger["spec"]["trainer"]["env"]] + [
            c["env"] for r in bigger["spec"]["runtimePatches"][0]["trainingRuntimeSpec"][
                "template"]["spec"]["replicatedJobs"]
            for c in r["template"]["spec"]["template"]["spec"]["containers"]]:
        next(e for e in env if e["name"] == "DMLC_NUM_WORKER")["value"] = "3"
    pods = render.jobset_pods(render.trainjob_jobset(runtime, bigger))
    _check_job(_placed(pods, "bps-tf-trainjob-token"), servers=2, workers=3)
    # Without the servers' patch they keep the runtime's 2: the scheduler then refuses the
    # third worker ("cluster setting 'num_workers' disagrees ... DMLC_NUM_WORKER").
    del bigger["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"][0]
    pods = render.jobset_pods(render.trainjob_jobset(runtime, bigger))
    counts = {cfg.role: cfg.num_workers for _, _, cfg in _placed(pods, "bps-tf-trainjob-token")}
    assert counts == {"server": 2, "worker": 3}


def test_a_missing_secret_stops_the_pod_as_the_kubelet_would():
    js = render.find(_docs("jobset.yaml"), render.JOBSET)
    pod = render.jobset_pods(js)[0]
    with pytest.raises(LookupError, match="bps-tf-jobset-token"):
        render.container_env(pod, "bps-tf", [render.secret_from_literal("other", token="x")])


# ------------------------------------------------- half-configured pods

JOBSET_POD = {"JOBSET_NAME": "js", "REPLICATED_JOB_NAME": "worker", "JOB_INDEX": "0",
              "JOB_COMPLETION_INDEX": "1", "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1"}


@pytest.mark.parametrize("change,expect", [
    ({"JOBSET_NAME": None}, "JOBSET_NAME is not set.*jobset.sigs.k8s.io/jobset-name"),
    ({"JOB_INDEX": None}, "JOB_INDEX is not set.*job-index"),
    ({"JOB_COMPLETION_INDEX": None}, "JOB_COMPLETION_INDEX is not set.*completionMode: Indexed"),
    ({"DMLC_NUM_WORKER": None}, "DMLC_NUM_WORKER is not set: Kubernetes does not tell"),
    ({"DMLC_NUM_SERVER": "0"}, "DMLC_NUM_SERVER='0' is out of range"),
    ({"REPLICATED_JOB_NAME": "ps"}, "'ps' names no bps_tf role.*server.*worker or node"),
    ({"JOB_INDEX": "1"}, "either by Job .* or by\\s+pod"),
    ({"JOB_COMPLETION_INDEX": "2"}, "index 2 .*DMLC_NUM_WORKER=2.*BYTEPS_ELASTIC=1"),
    ({"JOB_INDEX": "x"}, "JOB_INDEX='x' is not an integer"),
    ({"DMLC_WORKER_ID": "1"}, "DMLC_WORKER_ID is set, but this pod takes its place"),
    ({"BYTEPS_K8S_TEST_HOSTS": "js-server-0-0.js=10.1.2.3"}, "tests only.*loopback"),
    ({"REPLICATED_JOB_NAME": "server", "JOB_COMPLETION_INDEX": "1"}, "DMLC_NUM_SERVER=1"),
    ({"JOBSET_NAME": None, "REPLICATED_JOB_NAME": None, "JOB_NAME": "js-workers"},
     "'workers'.* names no bps_tf role"),
])
def test_a_half_configured_pod_is_refused_naming_the_fix(change, expect):
    env = {k: v for k, v in {**JOBSET_POD, **change}.items() if v is not None}
    with pytest.raises(cluster.ClusterSpecError, match=expect):
        cluster.resolve(env)


def test_bpslaunch_stops_a_half_configured_pod_before_starting_anything(capsys):
    env = {k: v for k, v in JOBSET_POD.items() if k != "JOB_INDEX"}
    assert launcher.run_cluster(["true"], environ=env) == launcher.EXIT_USAGE
    assert "JOB_INDEX is not set" in capsys.readouterr().err


def test_precedence_dmlc_then_tf_config_then_kubernetes():
    tf_config = json.dumps({"cluster": {"worker": ["a:1", "b:1"], "ps": ["c:1"]},
                            "task": {"type": "worker", "index": 1}})
    assert cluster.resolve(JOBSET_POD).source == "Kubernetes"
    assert cluster.resolve({**JOBSET_POD, "TF_CONFIG": tf_config}).source == "TF_CONFIG"
    dmlc = {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0", "DMLC_PS_ROOT_URI": "h",
            "DMLC_PS_ROOT_PORT": "9", "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1"}
    assert cluster.resolve({**JOBSET_POD, **dmlc, "TF_CONFIG": tf_config}).source == "DMLC"
    # A JOB_NAME alone (CI systems set one) is no Kubernetes job.
    assert cluster.resolve({"JOB_NAME": "nightly"}).source == "none"
    # The explicit addresses override the derived names.
    cfg = cluster.resolve({**JOBSET_POD, "DMLC_PS_ROOT_URI": "sched.example",
                           "DMLC_PS_ROOT_PORT": "9000", "DMLC_NODE_HOST": "10.0.0.7"})
    assert (cfg.scheduler_host, cfg.scheduler_port, cfg.advertise_host) == (
        "sched.example", 9000, "10.0.0.7")


# ------------------------------------------------------------ discovery

def _discover(monkeypatch, capsys, args, hosts):
    monkeypatch.setenv("BYTEPS_K8S_TEST_HOSTS", hosts)
    code = k8s_discovery.main(args)
    out = capsys.readouterr()
    return code, out.out.split(), out.err


def test_discovery_lists_the_pods_dns_knows(monkeypatch, capsys):
    job = render.find(_docs("indexed-job-elastic.yaml"), render.JOB, "bps-tf-elastic-worker")
    names = [render.dns_name(p) for p in render.indexed_job_pods(job, completions=3)]
    hosts = ",".join(f"{n}=127.0.0.{i + 2}" for i, n in enumerate(names) if i != 1)
    code, lines, err = _discover(monkeypatch, capsys, [
        "--job", "bps-tf-elastic-worker", "--service", "bps-tf-elastic", "--slots", "2",
        "--max-pods", "8"], hosts)
    assert code == 0, err
    assert lines == [f"{names[0]}:2", f"{names[2]}:2"]     # pod 1 is gone
    # A TrainJob's workers: its JobSet has the TrainJob's name, the workers' job is "node".
    code, lines, _ = _discover(monkeypatch, capsys, [
        "--jobset", "bps-tf-trainjob", "--replicated-job", "node"],
        "bps-tf-trainjob-node-0-1.bps-tf-trainjob=127.0.0.3")
    assert (code, lines) == (0, ["bps-tf-trainjob-node-0-1.bps-tf-trainjob:1"])
    code, _, err = _discover(monkeypatch, capsys, ["--jobset", "x"], "x-worker-0-0.x=192.168.1.1")
    assert code == 2 and "loopback" in err
    # Without the override each name is one DNS question, asked in parallel, kept in order.
    asked = []
    found = k8s_discovery.discover([f"w-{i}.s" for i in range(20)],
                                   lambda n: asked.append(n) or n.endswith(("-3.s", "-17.s")))
    assert found == ["w-3.s", "w-17.s"] and sorted(asked) == sorted(f"w-{i}.s" for i in range(20))
