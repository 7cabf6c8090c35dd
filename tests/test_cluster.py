"""bps_tf.runtime.cluster.resolve: DMLC_*, TF_CONFIG and no configuration at all."""
import json
import socket

import pytest

from bps_tf.runtime.cluster import ClusterConfig, ClusterSpecError, describe, join_host_port, resolve, split_host_port

CORE_KEYS = {"role", "rank", "num_workers", "num_servers", "scheduler_host", "scheduler_port",
             "server_id", "advertise_host", "port", "bind_host", "host_scheduler", "ready_file",
             "local_rank", "local_size", "hostname", "scheduler_origin", "members_origin"}


def dmlc(role, **extra):
    env = {"DMLC_ROLE": role, "DMLC_NUM_WORKER": "3", "DMLC_NUM_SERVER": "2",
           "DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "9000"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def tf_config(cluster, task_type, index=0, **top):
    spec = {"cluster": cluster, "task": {"type": task_type, "index": index}}
    spec.update(top)
    return {"TF_CONFIG": json.dumps(spec)}


def error_of(environ):
    with pytest.raises(ClusterSpecError) as info:
        resolve(environ)
    return str(info.value)


# ------------------------------------------------------------------ nothing set

def test_nothing_configured_is_local():
    cfg = resolve({})
    assert (cfg.role, cfg.rank, cfg.num_workers, cfg.num_servers) == ("local", 0, 1, 0)
    assert (cfg.local_rank, cfg.local_size, cfg.source) == (0, 1, "none")
    assert cfg.hostname == socket.gethostname()


def test_empty_tf_config_is_ignored():
    assert resolve({"TF_CONFIG": "  "}).role == "local"


def test_defaults_to_os_environ(monkeypatch):
    for name in ("DMLC_ROLE", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"worker": ["a:1", "b:1"], "ps": ["p:2"]}, "task": {"type": "worker", "index": 1}}))
    assert resolve().rank == 1


def test_core_values_has_exactly_the_contract_keys():
    values = resolve(dmlc("server", BYTEPS_HOST_SCHEDULER=1)).core_values()
    assert set(values) == CORE_KEYS
    assert values["host_scheduler"] == 1
    assert resolve({}).core_values()["host_scheduler"] == 0


# ------------------------------------------------------------------------ DMLC

def test_dmlc_worker():
    cfg = resolve(dmlc("worker", DMLC_WORKER_ID=2))
    assert (cfg.role, cfg.rank, cfg.num_workers, cfg.num_servers) == ("worker", 2, 3, 2)
    assert (cfg.scheduler_host, cfg.scheduler_port, cfg.source) == ("10.0.0.1", 9000, "DMLC")
    assert (cfg.local_rank, cfg.local_size, cfg.server_id) == (-1, -1, -1)


def test_dmlc_wins_over_tf_config():
    env = dmlc("worker", DMLC_WORKER_ID=0)
    env.update(tf_config({"worker": ["a:1", "b:1"], "ps": ["p:1"]}, "worker", 1))
    assert resolve(env).source == "DMLC"


@pytest.mark.parametrize("worker_id", ["3", "-1", "x", ""])
def test_dmlc_worker_id_checked(worker_id):
    message = error_of(dmlc("worker", DMLC_WORKER_ID=worker_id))
    assert "DMLC_WORKER_ID" in message
    if worker_id:
        assert repr(worker_id) in message


def test_dmlc_server_defaults():
    cfg = resolve(dmlc("server"))
    assert (cfg.role, cfg.server_id, cfg.port, cfg.bind_host) == ("server", -1, 0, "0.0.0.0")
    assert (cfg.advertise_host, cfg.host_scheduler, cfg.rank) == ("10.0.0.1", False, -1)


def test_dmlc_server_explicit():
    cfg = resolve(dmlc("server", BYTEPS_SERVER_ID=1, BYTEPS_SERVER_PORT=7000,
                       BYTEPS_BIND_HOST="127.0.0.1", DMLC_NODE_HOST="node-b"))
    assert (cfg.server_id, cfg.port, cfg.bind_host, cfg.advertise_host) == (1, 7000, "127.0.0.1", "node-b")


def test_dmlc_server_hosting_the_scheduler_binds_the_scheduler_port():
    cfg = resolve(dmlc("server", BYTEPS_SERVER_ID=0, BYTEPS_HOST_SCHEDULER=1))
    assert (cfg.host_scheduler, cfg.port) == (True, 9000)


def test_dmlc_scheduler_host_with_port_zero_needs_a_ready_file():
    env = dmlc("server", BYTEPS_HOST_SCHEDULER=1, DMLC_PS_ROOT_PORT=0)
    assert "BYTEPS_READY_FILE" in error_of(env)
    env["BYTEPS_READY_FILE"] = "/tmp/port"
    cfg = resolve(env)
    assert (cfg.port, cfg.ready_file) == (0, "/tmp/port")


def test_dmlc_port_zero_is_only_for_the_scheduler_host():
    assert "DMLC_PS_ROOT_PORT=0" in error_of(dmlc("worker", DMLC_WORKER_ID=0, DMLC_PS_ROOT_PORT=0))
    assert "DMLC_PS_ROOT_PORT=0" in error_of(dmlc("server", DMLC_PS_ROOT_PORT=0))


def test_dmlc_server_port_must_agree_with_the_scheduler_port_it_hosts():
    message = error_of(dmlc("server", BYTEPS_HOST_SCHEDULER=1, BYTEPS_SERVER_PORT=9001))
    assert "BYTEPS_SERVER_PORT=9001" in message and "DMLC_PS_ROOT_PORT" in message


def test_dmlc_scheduler():
    cfg = resolve(dmlc("scheduler", BYTEPS_BIND_HOST="[::]"))
    assert (cfg.role, cfg.port, cfg.bind_host, cfg.rank, cfg.server_id) == ("scheduler", 9000, "::", -1, -1)


@pytest.mark.parametrize("name, value, needle", [
    ("DMLC_ROLE", "chief", "DMLC_ROLE='chief'"),
    ("DMLC_NUM_WORKER", "0", "DMLC_NUM_WORKER='0'"),
    ("DMLC_NUM_WORKER", "two", "not an integer"),
    ("DMLC_NUM_SERVER", "0", "at least one server"),
    ("DMLC_PS_ROOT_URI", "", "DMLC_PS_ROOT_URI is not set"),
    ("DMLC_PS_ROOT_PORT", "70000", "DMLC_PS_ROOT_PORT='70000'"),
    ("BYTEPS_SERVER_ID", "2", "BYTEPS_SERVER_ID='2'"),
    ("BYTEPS_HOST_SCHEDULER", "maybe", "BYTEPS_HOST_SCHEDULER='maybe'"),
])
def test_dmlc_bad_values_are_named(name, value, needle):
    env = dmlc("server")
    env[name] = value
    assert needle in error_of(env)


def test_dmlc_missing_variable_is_named():
    env = dmlc("worker", DMLC_WORKER_ID=0)
    del env["DMLC_NUM_SERVER"]
    assert "DMLC_NUM_SERVER is not set" in error_of(env)


def test_local_overrides():
    cfg = resolve(dmlc("worker", DMLC_WORKER_ID=1, BYTEPS_LOCAL_RANK=1, BYTEPS_LOCAL_SIZE=2))
    assert (cfg.local_rank, cfg.local_size) == (1, 2)
    assert "BYTEPS_LOCAL_RANK=2" in error_of(
        dmlc("worker", DMLC_WORKER_ID=1, BYTEPS_LOCAL_RANK=2, BYTEPS_LOCAL_SIZE=2))
    assert "BYTEPS_LOCAL_SIZE='0'" in error_of(dmlc("worker", DMLC_WORKER_ID=1, BYTEPS_LOCAL_SIZE=0))


# ------------------------------------------------------------------- TF_CONFIG

CLUSTER = {"chief": ["chief-0:2222"], "worker": ["worker-0:2222", "worker-1:2222"],
           "ps": ["ps-0:2222", "ps-1:2223"]}


def test_tf_config_chief_is_rank_zero_then_workers():
    ranks = [resolve(tf_config(CLUSTER, "chief", 0)).rank,
             resolve(tf_config(CLUSTER, "worker", 0)).rank,
             resolve(tf_config(CLUSTER, "worker", 1)).rank]
    assert ranks == [0, 1, 2]
    cfg = resolve(tf_config(CLUSTER, "worker", 1))
    assert (cfg.role, cfg.num_workers, cfg.num_servers) == ("worker", 3, 2)
    assert (cfg.scheduler_host, cfg.scheduler_port, cfg.advertise_host) == ("ps-0", 2222, "worker-1")
    assert cfg.source == "TF_CONFIG"


def test_tf_config_ps_tasks_are_servers_and_ps0_hosts_the_scheduler():
    ps0 = resolve(tf_config(CLUSTER, "ps", 0))
    ps1 = resolve(dict(tf_config(CLUSTER, "ps", 1), BYTEPS_BIND_HOST="10.1.1.1"))
    assert (ps0.role, ps0.server_id, ps0.port, ps0.host_scheduler) == ("server", 0, 2222, True)
    assert (ps1.role, ps1.server_id, ps1.port, ps1.host_scheduler) == ("server", 1, 2223, False)
    assert (ps1.advertise_host, ps1.bind_host, ps0.bind_host) == ("ps-1", "10.1.1.1", "0.0.0.0")
    assert (ps1.scheduler_host, ps1.scheduler_port) == ("ps-0", 2222)


def test_tf_config_master_is_an_alias_of_chief():
    cluster = {"master": ["m:1"], "worker": ["w:1"], "ps": ["p:1"]}
    assert resolve(tf_config(cluster, "master")).rank == 0
    assert resolve(tf_config(cluster, "chief")).rank == 0
    assert resolve(tf_config(cluster, "worker")).rank == 1


def test_tf_config_chief_and_master_together_is_an_error():
    cluster = dict(CLUSTER, master=["m:1"])
    assert "'chief' and 'master'" in error_of(tf_config(cluster, "worker"))


def test_tf_config_evaluator_runs_alone():
    cfg = resolve(tf_config(dict(CLUSTER, evaluator=["eval-0:2222"]), "evaluator"))
    assert (cfg.role, cfg.rank, cfg.num_workers, cfg.num_servers) == ("evaluator", 0, 1, 0)
    assert (cfg.local_rank, cfg.local_size) == (0, 1)
    # Estimator-style: the evaluator is not listed in the cluster at all.
    assert resolve(tf_config(CLUSTER, "evaluator")).role == "evaluator"


def test_tf_config_one_worker_without_ps_is_local():
    cfg = resolve(tf_config({"worker": ["w:1"]}, "worker"))
    assert (cfg.role, cfg.rank, cfg.num_workers, cfg.source) == ("local", 0, 1, "TF_CONFIG")
    assert resolve(tf_config({"chief": ["c:1"]}, "chief")).role == "local"


def test_tf_config_several_workers_without_ps_is_an_error():
    message = error_of(tf_config({"chief": ["c:1"], "worker": ["w:1"]}, "worker"))
    assert "at least one 'ps' task" in message


def test_tf_config_malformed_json_shows_the_parse_error():
    message = error_of({"TF_CONFIG": '{"cluster": {"worker": ["a:1"]'})
    assert "not valid JSON" in message and "line 1 column" in message


def test_tf_config_not_an_object():
    assert "JSON object" in error_of({"TF_CONFIG": "[1, 2]"})


@pytest.mark.parametrize("task_type, index, needle", [
    ("worker", 2, "index 2 is out of range"),
    ("ps", 5, "index 5 is out of range"),
    ("chief", 1, "index 1 is out of range"),
    ("worker", -1, "not a non-negative integer"),
    ("worker", "x", "not a non-negative integer"),
])
def test_tf_config_bad_index(task_type, index, needle):
    assert needle in error_of(tf_config(CLUSTER, task_type, index))


def test_tf_config_index_may_be_a_string():
    assert resolve(tf_config(CLUSTER, "worker", "1")).rank == 2


def test_tf_config_unknown_task_type_is_named():
    message = error_of(tf_config(CLUSTER, "scheduler"))
    assert "'scheduler'" in message and "ps:0" in message


def test_tf_config_unknown_cluster_job_is_named():
    assert "'tpu'" in error_of(tf_config(dict(CLUSTER, tpu=["t:1"]), "worker"))


def test_tf_config_missing_task():
    assert "no 'task'" in error_of({"TF_CONFIG": json.dumps({"cluster": CLUSTER})})


def test_tf_config_task_not_in_cluster():
    assert "no 'worker' job" in error_of(tf_config({"chief": ["c:1"], "ps": ["p:1"]}, "worker"))


def test_tf_config_without_workers():
    assert "no 'chief' or 'worker'" in error_of(tf_config({"ps": ["p:1"]}, "ps"))


def test_tf_config_sparse_cluster_is_refused():
    env = {"TF_CONFIG": json.dumps({"sparseCluster": {"worker": {"1": "w:1"}},
                                    "task": {"type": "worker", "index": 1}})}
    assert "sparseCluster" in error_of(env)


def test_tf_config_ipv6_addresses():
    cluster = {"worker": ["[::1]:2222", "[::1]:2223"], "ps": ["[fe80::1]:2224"]}
    worker = resolve(tf_config(cluster, "worker", 1))
    assert (worker.advertise_host, worker.scheduler_host, worker.scheduler_port) == ("::1", "fe80::1", 2224)
    ps = resolve(tf_config(cluster, "ps", 0))
    assert (ps.advertise_host, ps.port) == ("fe80::1", 2224)
    assert join_host_port(ps.advertise_host, ps.port) == "[fe80::1]:2224"


@pytest.mark.parametrize("address, needle", [
    ("ps-0", "has no port"),
    ("ps-0:http", "port must be a number"),
    ("ps-0:0", "port must be a number"),
    (":2222", "has no host"),
    ("::1:2222", "IPv6 address needs brackets"),
    ("[::1]2222", "not a host:port"),
    (42, "not a host:port"),
])
def test_tf_config_bad_addresses(address, needle):
    message = error_of(tf_config({"worker": ["w:1", "w:2"], "ps": [address]}, "worker"))
    assert needle in message and "ps:0" in message


def test_tf_config_duplicate_addresses():
    message = error_of(tf_config({"worker": ["a:1", "b:1"], "ps": ["A:1"]}, "worker"))
    assert "ps:0" in message and "worker:0" in message


def test_split_host_port():
    assert split_host_port("host.ns.svc:2222", "x") == ("host.ns.svc", 2222)
    assert split_host_port(" [::1]:80 ", "x") == ("::1", 80)


def test_kubeflow_tfjob_every_pod():
    """A TFJob with 1 chief, 2 workers and 2 ps: what each pod becomes."""
    def svc(name):
        return f"dist-mnist-{name}.kubeflow.svc:2222"
    cluster = {"chief": [svc("chief-0")], "worker": [svc("worker-0"), svc("worker-1")],
               "ps": [svc("ps-0"), svc("ps-1")]}
    expected = {("chief", 0): ("worker", 0, -1), ("worker", 0): ("worker", 1, -1),
                ("worker", 1): ("worker", 2, -1), ("ps", 0): ("server", -1, 0),
                ("ps", 1): ("server", -1, 1)}
    for (task_type, index), (role, rank, server_id) in expected.items():
        cfg = resolve(tf_config(cluster, task_type, index, environment="cloud"))
        assert (cfg.role, cfg.rank, cfg.server_id) == (role, rank, server_id), (task_type, index)
        assert (cfg.num_workers, cfg.num_servers) == (3, 2)
        assert (cfg.scheduler_host, cfg.scheduler_port) == ("dist-mnist-ps-0.kubeflow.svc", 2222)
        assert cfg.host_scheduler == (task_type == "ps" and index == 0)
        assert (cfg.local_rank, cfg.local_size) == (-1, -1)
        assert describe(cfg).startswith(f"bps_tf {role}")


def test_describe_every_role():
    lines = [describe(resolve(env)) for env in (
        {}, dmlc("worker", DMLC_WORKER_ID=0), dmlc("server"), dmlc("scheduler"),
        tf_config(CLUSTER, "evaluator"), tf_config(CLUSTER, "ps", 0))]
    assert all("\n" not in line for line in lines)
    assert "rank 0 of 3" in lines[1]
    assert "hosts the scheduler" in lines[5]
    assert isinstance(resolve({}), ClusterConfig)
