"""strategy.cluster_resolver answers TensorFlow's questions (task_type, task_id,
cluster_spec()) from the same source that placed the process in the job."""
import json

from bps_tf.strategy.cluster_resolver import make_cluster_resolver


def test_no_cluster_is_worker_zero_of_one():
    r = make_cluster_resolver({})
    assert (r.task_type, r.task_id) == ("worker", 0)
    assert r.cluster_spec().num_tasks("worker") == 1


def test_tf_config_is_reported_as_tensorflow_would():
    tf_config = {"cluster": {"chief": ["h0:1"], "worker": ["h1:2", "h2:3"], "ps": ["p0:4"]},
                 "task": {"type": "worker", "index": 1}}
    r = make_cluster_resolver({"TF_CONFIG": json.dumps(tf_config)})
    assert (r.task_type, r.task_id) == ("worker", 1)
    assert r.cluster_spec().as_dict() == tf_config["cluster"]
    tf_config["task"] = {"type": "chief", "index": 0}
    r = make_cluster_resolver({"TF_CONFIG": json.dumps(tf_config)})
    assert (r.task_type, r.task_id) == ("chief", 0)


def test_dmlc_worker_knows_its_rank_and_the_scheduler():
    env = {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "1", "DMLC_NUM_WORKER": "2",
           "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "1234",
           "DMLC_NODE_HOST": "127.0.0.7"}
    r = make_cluster_resolver(env)
    assert (r.task_type, r.task_id) == ("worker", 1)
    spec = r.cluster_spec()
    assert spec.task_address("worker", 1) == "127.0.0.7:0"
    assert spec.task_address("ps", 0) == "127.0.0.1:1234"
