"""The hook registry (bps_tf/hooks/registry.py): targets found by role, and
what happens when a Keras/TensorFlow release moves one (tests/
test_hook_renames.py renames every entry's name across a copy of Keras).

The registry's own rules run in this process without TensorFlow; a fresh
process trains with every hook in place. What bps_tf does when a release
moves a target is tests/test_hook_renames.py's.
"""
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import pytest

from bps_tf.hooks import registry as hooks
from bps_tf.hooks import versions

TIMEOUT_S = 300


@pytest.fixture
def registry(monkeypatch):
    """An empty registry for this test (the real one is left as it was)."""
    monkeypatch.setattr(hooks, "_hooks", {})
    monkeypatch.setattr(hooks, "_missing", {})
    monkeypatch.setattr(hooks, "_installed", set())
    monkeypatch.setattr(hooks, "_warned", set())
    return hooks


class _Target:
    def method(self):
        return "original"


def test_a_hook_wraps_its_target_once_and_calls_the_original(registry):
    calls = []

    @registry.register("Target.method", "t", lambda: (_Target, "method"), changes="c", why="w",
                       when_missing="error")
    def wrap(original):
        def method(self):
            calls.append(1)
            return original(self)
        return method

    original = _Target.method
    try:
        assert registry.install("t") == {}
        assert registry.install("t") == {}          # a second install changes nothing
        assert _Target().method() == "original" and calls == [1]
        assert registry.is_installed("Target.method")
    finally:
        _Target.method = original


def test_a_target_declared_twice_is_refused(registry):
    registry.register("x.y", "t", lambda: (_Target, "method"), changes="c", why="w",
                      when_missing="cosmetic")(lambda original: original)
    with pytest.raises(ValueError, match="declared twice"):
        registry.register("x.y", "t", lambda: (_Target, "method"), changes="c", why="w",
                          when_missing="cosmetic")(lambda original: original)
    with pytest.raises(ValueError, match="when_missing"):
        registry.register("x.z", "t", lambda: (_Target, "method"), changes="c", why="w",
                          when_missing="ignore")


def test_a_missing_target_is_reported_by_policy(registry, caplog):
    for name, policy in (("gone.error", "error"), ("gone.fallback", "fallback"),
                         ("gone.cosmetic", "cosmetic")):
        registry.register(name, "t", registry.attribute_of("json", "no_such_name"), changes="c",
                          why="w", when_missing=policy)(lambda original: original)
    missing = registry.install("t")
    assert set(missing) == {"gone.error", "gone.fallback", "gone.cosmetic"}
    assert "json.no_such_name does not exist" in missing["gone.error"]
    with pytest.raises(registry.HookError) as info:
        registry.require("t", "Feature X")
    message = str(info.value)
    assert "Feature X" in message and "gone.error" in message and "gone.fallback" not in message
    assert "Last verified: Keras" in message
    with caplog.at_level(logging.WARNING, logger="bps_tf"):
        registry.warn_fallback("t", "doing the safe thing")
        registry.warn_fallback("t", "doing the safe thing")
    warnings = [r.getMessage() for r in caplog.records if "doing the safe thing" in r.getMessage()]
    assert len(warnings) == 1 and "gone.fallback" in warnings[0] and "gone.cosmetic" not in \
        warnings[0]


def test_defining_class_follows_the_mro_not_a_name():
    class Base:
        def make_train_function(self):
            pass

    class Renamed(Base):      # what Keras 3.16 did to TensorFlowTrainer
        pass

    class Model(Renamed):
        pass

    assert hooks.defining_class(Model, "make_train_function") is Base
    with pytest.raises(hooks.HookMissing, match="defines 'nothing'"):
        hooks.defining_class(Model, "nothing")


def _run(*parts, **env):
    """Runs the script made of ``parts`` (each dedented) in a fresh process
    in a neutral folder; its last stdout line is a JSON object."""
    script = "\n".join(textwrap.dedent(part) for part in parts)
    full = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **env)
    for key in [k for k in full if k.startswith(("DMLC_", "BYTEPS_"))] + ["TF_CONFIG"]:
        full.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", script],
                          cwd=tempfile.gettempdir(), env=full, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1]), proc.stderr


TRAIN = """
import json, logging, numpy as np, keras
import bps_tf
from bps_tf.hooks import registry as hooks

records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("bps_tf").addHandler(Keep())

def train(**strategy_args):
    keras.utils.set_random_seed(1)
    x = np.random.RandomState(0).normal(size=(64, 8)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
    strategy = bps_tf.BytePSStrategy(**strategy_args)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    return strategy, [w.tolist() for w in model.get_weights()]
"""


def test_with_every_hook_the_overlap_is_on():
    out, _ = _run(TRAIN, """
        strategy, _ = train()
        print(json.dumps({"overlap": strategy.overlap, "missing": hooks.missing()}))
        """)
    assert out == {"overlap": True, "missing": {}}


def test_the_keras_floor_is_checked(monkeypatch):
    import keras
    for old in ("3.7.0", "3.8.0", "3.9.2"):
        monkeypatch.setattr(keras, "__version__", old)
        with pytest.raises(hooks.HookError, match=rf"Keras >= 3\.10 \(found {re.escape(old)}\)"):
            versions.check_keras_version()
    monkeypatch.setattr(keras, "__version__", "3.10.0")
    versions.check_keras_version()
    monkeypatch.setattr(keras, "__version__", "3.16.0.dev2026102704")
    versions.check_keras_version()


def test_versions_newer_than_verified_get_one_warning_naming_them(monkeypatch, caplog):
    import types
    monkeypatch.setitem(sys.modules, "keras", types.SimpleNamespace(__version__="3.16.0"))
    monkeypatch.setitem(sys.modules, "tensorflow", types.SimpleNamespace(__version__="2.23.0"))
    monkeypatch.setattr(versions, "_said", versions.threading.Event())
    with caplog.at_level(logging.WARNING, logger="bps_tf"):
        assert versions.warn_if_newer()
        assert not versions.warn_if_newer()            # once per process
    said = [r.getMessage() for r in caplog.records if "newer than" in r.getMessage()]
    assert len(said) == 1, said
    assert "Keras 3.16.0 (last verified: 3.15.1" in said[0], said
    assert "TensorFlow 2.23.0 (last verified: 2.21.0" in said[0], said
    # The verified releases and pre-releases, and older ones, are silent.
    monkeypatch.setattr(versions, "_said", versions.threading.Event())
    for keras_version, tf_version in (("3.15.1", "2.21.0"), ("3.16.0.dev2026102704", "2.22.0rc0"),
                                      ("3.10.0", "2.16.2")):
        sys.modules["keras"].__version__ = keras_version
        sys.modules["tensorflow"].__version__ = tf_version
        assert not versions.warn_if_newer(), (keras_version, tf_version)


def test_the_docs_table_is_current():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "tools", "gen_hooks_doc.py"),
                           "--check"], cwd=tempfile.gettempdir(), capture_output=True, text=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"), timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
