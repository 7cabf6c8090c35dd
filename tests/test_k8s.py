"""examples/k8s/tfjob.yaml is a valid TFJob, and every pod it makes gets the right role.

The manifest is read with PyYAML when it is installed and always with the
small loader below, which understands the YAML subset the manifest is written
in (block mappings and sequences, scalars, JSON-style flow lists, comments);
PyYAML is not a dependency of bps_tf. When both are present they must agree.

For each pod, the test writes the TF_CONFIG that Kubeflow's training operator
would inject and checks what ``bps_tf.runtime.cluster.resolve`` makes of it.
"""
import json
import os
import re

import pytest

from bps_tf.runtime import cluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = os.path.join(ROOT, "examples", "k8s", "tfjob.yaml")
COMMAND = ["bpslaunch", "python", "examples/keras_digits.py"]
TFJOB_PORT_NAME = "tfjob-port"
OPERATOR_DEFAULT_PORT = 2222
RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")


# ------------------------------------------------------------ YAML subset

class YamlSubsetError(ValueError):
    pass


def _strip_comment(text):
    quote = None
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1] in " \t"):
            return text[:i].rstrip()
    return text.rstrip()


def _scalar(text, where):
    if text[:1] in "&*|>!" or text == "---":
        raise YamlSubsetError(f"{where}: {text!r} is outside the YAML subset this loader reads")
    if text[:1] in "[{\"":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise YamlSubsetError(f"{where}: write {text!r} as JSON ({exc})") from None
    if text[:1] == "'":
        if len(text) < 2 or not text.endswith("'"):
            raise YamlSubsetError(f"{where}: unterminated quote in {text!r}")
        return text[1:-1].replace("''", "'")
    if text in ("true", "True"):
        return True
    if text in ("false", "False"):
        return False
    if text in ("null", "~", ""):
        return None
    if re.fullmatch(r"[-+]?\d+", text):
        return int(text)
    return text


def load_yaml_subset(text):
    """Block mappings, block sequences and scalars; one document."""
    lines = []
    for number, raw in enumerate(text.splitlines(), 1):
        if "\t" in raw[:len(raw) - len(raw.lstrip())]:
            raise YamlSubsetError(f"line {number}: tabs are not allowed in indentation")
        content = _strip_comment(raw)
        if content.strip():
            lines.append((len(content) - len(content.lstrip()), content.strip(), number))

    def block(i, indent):
        if lines[i][1].startswith("- ") or lines[i][1] == "-":
            return sequence(i, indent)
        return mapping(i, indent)

    def nested(i, parent_indent):
        # The value of "key:" or "-" with nothing after it: a deeper block, or a
        # sequence at the key's own indentation, or nothing.
        if i < len(lines) and lines[i][0] > parent_indent:
            return block(i, lines[i][0])
        return None, i

    def mapping(i, indent):
        result = {}
        while i < len(lines) and lines[i][0] == indent and not lines[i][1].startswith("-"):
            _, content, number = lines[i]
            match = re.fullmatch(r"([A-Za-z0-9_.\-/]+):(?:\s+(.*))?", content)
            if not match:
                raise YamlSubsetError(f"line {number}: expected 'key: value', got {content!r}")
            key, rest = match.group(1), match.group(2)
            if key in result:
                raise YamlSubsetError(f"line {number}: duplicate key {key!r}")
            if rest:
                result[key], i = _scalar(rest, f"line {number}"), i + 1
            elif i + 1 < len(lines) and lines[i + 1][0] == indent and lines[i + 1][1].startswith("-"):
                result[key], i = sequence(i + 1, indent)
            else:
                result[key], i = nested(i + 1, indent)
        if i < len(lines) and lines[i][0] > indent:
            raise YamlSubsetError(f"line {lines[i][2]}: unexpected indentation")
        return result, i

    def sequence(i, indent):
        result = []
        while i < len(lines) and lines[i][0] == indent and (lines[i][1].startswith("- ")
                                                            or lines[i][1] == "-"):
            _, content, number = lines[i]
            item = content[1:].strip()
            if not item:
                value, i = nested(i + 1, indent)
            elif re.match(r"[A-Za-z0-9_.\-/]+:(\s|$)", item):
                # "- key: value" opens a mapping whose keys line up after "- ".
                lines[i] = (indent + 2, item, number)
                value, i = mapping(i, indent + 2)
            else:
                value, i = _scalar(item, f"line {number}"), i + 1
            result.append(value)
        return result, i

    if not lines:
        return None
    value, end = block(0, lines[0][0])
    if end != len(lines):
        raise YamlSubsetError(f"line {lines[end][2]}: unexpected content {lines[end][1]!r}")
    return value


def test_yaml_subset_loader_reads_what_it_claims():
    text = """
a: 1          # comment
b:
  - x
  - "y # not a comment"
  - k: v
    n: [1, "two"]
c:
- 'it''s'
d:
  e: true
  f:
"""
    assert load_yaml_subset(text) == {
        "a": 1, "b": ["x", "y # not a comment", {"k": "v", "n": [1, "two"]}],
        "c": ["it's"], "d": {"e": True, "f": None}}
    with pytest.raises(YamlSubsetError, match="outside the YAML subset"):
        load_yaml_subset("a: &anchor 1\n")


# -------------------------------------------------------------- manifest

@pytest.fixture(scope="module")
def tfjob():
    with open(MANIFEST) as f:
        text = f.read()
    manifest = load_yaml_subset(text)
    try:
        import yaml
    except ImportError:
        return manifest
    assert yaml.safe_load(text) == manifest, "the subset loader misread the manifest"
    return manifest


def _tensorflow_container(replica_spec):
    containers = replica_spec["template"]["spec"]["containers"]
    named = [c for c in containers if c.get("name") == "tensorflow"]
    # The operator injects TF_CONFIG only into the container named "tensorflow".
    assert len(named) == 1, containers
    return named[0]


def _tfjob_port(container):
    for port in container.get("ports", []):
        if port.get("name") == TFJOB_PORT_NAME:
            return port["containerPort"]
    return OPERATOR_DEFAULT_PORT


def test_manifest_is_a_tfjob_with_chief_worker_and_two_ps(tfjob):
    assert tfjob["apiVersion"] == "kubeflow.org/v1"
    assert tfjob["kind"] == "TFJob"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", tfjob["metadata"]["name"])
    specs = tfjob["spec"]["tfReplicaSpecs"]
    assert {name: spec["replicas"] for name, spec in specs.items()} == {
        "Chief": 1, "Worker": 1, "PS": 2}
    for name, spec in specs.items():
        assert spec["restartPolicy"] in RESTART_POLICIES, name
        container = _tensorflow_container(spec)
        assert container["command"] == COMMAND, name
        assert container["image"], name
        assert container["ports"][0] == {"name": TFJOB_PORT_NAME, "containerPort": 2222}, name
        env = {e["name"]: e for e in container.get("env", [])}
        for variable in env.values():
            if "value" in variable:
                assert isinstance(variable["value"], str), "Kubernetes env values are strings"
        # A multi-host job needs one token on every pod; a Secret supplies it.
        token = env["BYTEPS_JOB_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert token == {"name": f"{tfjob['metadata']['name']}-token", "key": "token"}, name
    # The command runs from the image's copy of this repository.
    assert os.path.isfile(os.path.join(ROOT, COMMAND[-1]))


def operator_tf_configs(tfjob):
    """pod name -> (replica type, the TF_CONFIG Kubeflow's training operator gives it).

    The operator's rules: task types are the replica types in lowercase; every
    replica has its own Service, <job>-<type>-<index>.<namespace>.svc, on the
    port named tfjob-port (2222 by default); "environment" is "cloud".
    """
    job = tfjob["metadata"]["name"]
    namespace = tfjob["metadata"].get("namespace", "default")
    specs = tfjob["spec"]["tfReplicaSpecs"]
    cluster_spec = {}
    for replica_type, spec in specs.items():
        task_type = replica_type.lower()
        port = _tfjob_port(_tensorflow_container(spec))
        cluster_spec[task_type] = [f"{job}-{task_type}-{i}.{namespace}.svc:{port}"
                                   for i in range(spec["replicas"])]
    configs = {}
    for replica_type in specs:
        task_type = replica_type.lower()
        for index in range(len(cluster_spec[task_type])):
            configs[f"{job}-{task_type}-{index}"] = replica_type, json.dumps({
                "cluster": cluster_spec,
                "task": {"type": task_type, "index": index},
                "environment": "cloud",
            })
    return configs


def test_every_pod_resolves_to_its_bps_tf_role(tfjob):
    configs = operator_tf_configs(tfjob)
    job = tfjob["metadata"]["name"]
    namespace = tfjob["metadata"]["namespace"]
    scheduler = f"{job}-ps-0.{namespace}.svc"
    seen = {}
    for pod, (replica_type, tf_config) in configs.items():
        # The pod's environment: the container's own variables plus TF_CONFIG.
        container = _tensorflow_container(tfjob["spec"]["tfReplicaSpecs"][replica_type])
        env = {e["name"]: e.get("value", "from-a-secret") for e in container.get("env", [])}
        env["TF_CONFIG"] = tf_config
        cfg = cluster.resolve(env)
        assert cfg.source == "TF_CONFIG", pod
        assert (cfg.num_workers, cfg.num_servers) == (2, 2), pod
        assert (cfg.scheduler_host, cfg.scheduler_port) == (scheduler, 2222), pod
        seen[pod] = (cfg.role, cfg.rank if cfg.role == "worker" else cfg.server_id,
                     cfg.host_scheduler)
        assert cfg.advertise_host == f"{pod}.{namespace}.svc", pod
        if cfg.role == "server":
            # Servers listen on every interface, on their own Service's port.
            assert (cfg.bind_host, cfg.port) == ("0.0.0.0", 2222), pod
        assert cluster.describe(cfg).startswith("bps_tf "), pod
    assert seen == {
        f"{job}-chief-0": ("worker", 0, False),
        f"{job}-worker-0": ("worker", 1, False),
        f"{job}-ps-0": ("server", 0, True),     # ps-0 hosts the scheduler
        f"{job}-ps-1": ("server", 1, False),
    }



def test_servers_have_grpc_health_probes_on_their_health_port(tfjob):
    """PS pods serve grpc.health.v1 on BYTEPS_HEALTH_PORT; kubelet's grpc probes ask it.

    Readiness must not wait for the cluster to meet (service ""): the workers
    reach ps-0 through its Service, which lists only ready pods, so such a
    probe would keep the job from ever meeting.
    """
    from bps_tf.runtime import config, health
    for name, spec in tfjob["spec"]["tfReplicaSpecs"].items():
        container = _tensorflow_container(spec)
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if name != "PS":
            assert "BYTEPS_HEALTH_PORT" not in env and "readinessProbe" not in container, name
            assert container["ports"] == [{"name": TFJOB_PORT_NAME, "containerPort": 2222}], name
            continue
        port = config.value("BYTEPS_HEALTH_PORT", env)
        assert port and port != 2222
        assert {"name": "health", "containerPort": port} in container["ports"]
        for probe in ("readinessProbe", "livenessProbe"):
            stanza = container[probe]
            assert set(stanza) - {"initialDelaySeconds", "periodSeconds", "failureThreshold",
                                  "timeoutSeconds", "successThreshold"} == {"grpc"}, probe
            assert stanza["grpc"] == {"port": port, "service": health.SERVICE_LIVE}, probe
