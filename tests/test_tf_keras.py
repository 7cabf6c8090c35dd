"""Keras 2 (tf_keras, TF_USE_LEGACY_KERAS=1): Horovod's Keras-2 scripts keep
working with bps_tf.keras. One 2-worker cluster runs
tests/workers/tf_keras_checks.py; the Horovod-style example, with only its
import line changed, runs on Keras 2 and on Keras 3; the BytePS-style
DistributedGradientTape example runs too.

tf_keras is fetched here, into a temporary folder, in the release that
matches the installed TensorFlow: as a requirement, its dependency on the
`tensorflow` package would install a second TensorFlow over tensorflow-cpu.
"""
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_runner import ROOT, launch, passed_details, run_checks  # noqa: E402

tf = pytest.importorskip("tensorflow")

CHECKS = os.path.join(ROOT, "tests", "workers", "tf_keras_checks.py")
EXAMPLE = os.path.join(ROOT, "examples", "keras_horovod_style.py")


@pytest.fixture(scope="module")
def legacy_env(tmp_path_factory):
    """Environment for Keras-2 processes: TF_USE_LEGACY_KERAS=1 and a
    tf_keras matching this TensorFlow on PYTHONPATH."""
    target = str(tmp_path_factory.mktemp("tf_keras_pkg"))
    major_minor = ".".join(tf.__version__.split(".")[:2])
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target,
         f"tf_keras=={major_minor}.*"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"cannot fetch tf_keras {major_minor}.* for TensorFlow "
                                  f"{tf.__version__}:\n{proc.stderr[-3000:]}")
    path = os.pathsep.join(p for p in (target, os.environ.get("PYTHONPATH")) if p)
    return {"TF_USE_LEGACY_KERAS": "1", "BYTEPS_OP_TIMEOUT": "60", "PYTHONPATH": path}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, legacy_env):
    out = str(tmp_path_factory.mktemp("tf_keras"))
    found, log, code = run_checks(2, 1, CHECKS, out, env=legacy_env, timeout=300)
    return found, log


@pytest.mark.parametrize("name", ["is_tf_keras", "sgd_fit", "legacy_momentum_fit",
                                  "adam_predivide_fit", "warmup", "aggregated_fit_summed",
                                  "aggregated_fit_averaged", "local_var", "sync_batch_norm",
                                  "load_model", "momentum_correction",
                                  "compression_under_strategy", "mixed_precision",
                                  "mixed_precision_legacy", "elastic_keras_state",
                                  "elastic_callbacks",
                                  "broadcast_unbuilt",
                                  "finished"])
def test_tf_keras_check(ranks, name):
    passed_details(*ranks, name)


@pytest.mark.parametrize("keras_version", [2, 3])
def test_horovod_style_keras_example_runs_with_one_import_changed(legacy_env, keras_version):
    env = legacy_env if keras_version == 2 else {"BYTEPS_OP_TIMEOUT": "60"}
    proc = launch(2, 1, [EXAMPLE, "--epochs", "2"], env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # Rank 0 prints the averaged accuracy; synthetic digits are learnable.
    lines = [ln for ln in proc.stdout.splitlines() if "final accuracy" in ln]
    assert len(lines) == 1, proc.stdout[-3000:]
    assert float(lines[0].rsplit(" ", 1)[1]) >= 0.9, lines[0]


def test_byteps_style_tape_example_runs_with_one_import_changed():
    example = os.path.join(ROOT, "examples", "tf2_digits_tape.py")
    proc = launch(2, 1, [example, "--epochs", "5"], env={"BYTEPS_OP_TIMEOUT": "60"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [ln for ln in proc.stdout.splitlines() if "test accuracy:" in ln]
    assert len(lines) == 1 and "(2 workers)" in lines[0], proc.stdout[-3000:]
    assert float(lines[0].split("test accuracy:")[1].split()[0]) >= 0.8, lines[0]
