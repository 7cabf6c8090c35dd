"""The hook registry (bps_tf/runtime/hooks.py): targets found by role, and
what happens when a Keras/TensorFlow release moves one.

The registry's own rules run in this process without TensorFlow. The checks
that hide a hook's target run in fresh processes: each removes or renames
something of Keras *before* bps_tf installs its hooks, as a future release
would, then trains a small model in a single process (no cluster).
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

from bps_tf.runtime import hooks

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
from bps_tf.runtime import hooks

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


def test_the_overlap_falls_back_to_the_barrier_with_the_same_weights():
    # A Keras that moved the method the deferred update calls: its lookup
    # fails (Keras' own calls of it are left working, as they would be).
    out, _ = _run("""
        from bps_tf.runtime import hooks
        from bps_tf.overlap import fit  # declares the overlap's hooks
        def moved():
            raise hooks.HookMissing("no class in Optimizer's MRO defines '_backend_update_step'")
        hooks._hooks["keras.optimizers.Optimizer._backend_update_step"].locate = moved
        """, TRAIN, """
        hidden, weights = train()                 # overlap asked for (the default)
        barrier, expected = train(overlap=False)
        print(json.dumps({"overlap": hidden.overlap, "same": weights == expected,
                          "missing": sorted(hooks.missing()),
                          "warnings": [r for r in records if "overlap is off" in r]}))
        """)
    assert out["overlap"] is False
    assert out["same"], "the fallback trained a different model than the barrier"
    assert out["missing"] == ["keras.optimizers.Optimizer._backend_update_step"]
    assert len(out["warnings"]) == 1, out["warnings"]
    warning = out["warnings"][0]
    assert "_backend_update_step" in warning and "Keras (" in warning and "verified on" in \
        warning


def test_with_every_hook_the_overlap_is_on():
    out, _ = _run(TRAIN, """
        strategy, _ = train()
        print(json.dumps({"overlap": strategy.overlap, "missing": hooks.missing()}))
        """)
    assert out == {"overlap": True, "missing": {}}


def test_a_missing_hook_that_cannot_fall_back_is_a_clear_error():
    out, _ = _run("""
        import json, keras
        del keras.optimizers.LossScaleOptimizer.check_finite
        import bps_tf
        from bps_tf.runtime import hooks
        try:
            bps_tf.BytePSStrategy()
            print(json.dumps({"error": None}))
        except hooks.HookError as exc:
            print(json.dumps({"error": str(exc), "type": type(exc).__name__}))
        """)
    assert out["error"] is not None, "BytePSStrategy() ran without the loss-scale check's hook"
    message = out["error"]
    assert "keras.optimizers.LossScaleOptimizer.check_finite" in message
    assert "BytePSStrategy" in message and "Last verified: Keras" in message
    import keras
    assert f"Keras ({keras.__version__})" in message


def test_renamed_trainer_classes_are_found_by_role():
    # Keras 3.16 renamed the backend's TensorFlowTrainer to Trainer (and the
    # base Trainer to BaseTrainer): the name bps_tf once patched is gone.
    out, _ = _run("""
        import sys, keras
        trainer = next(c for c in keras.Model.__mro__ if "make_train_function" in vars(c))
        backend = sys.modules[trainer.__module__]
        setattr(backend, "Renamed" + trainer.__name__, trainer)
        delattr(backend, trainer.__name__)
        """, TRAIN, """
        strategy, weights = train()
        print(json.dumps({"missing": hooks.missing(), "overlap": strategy.overlap,
                          "trained": len(weights)}))
        """)
    assert out == {"missing": {}, "overlap": True, "trained": 4}


def test_the_keras_floor_is_checked(monkeypatch):
    import keras
    for old in ("3.7.0", "3.8.0", "3.9.2"):
        monkeypatch.setattr(keras, "__version__", old)
        with pytest.raises(hooks.HookError, match=rf"Keras >= 3\.10 \(found {re.escape(old)}\)"):
            hooks.check_keras_version()
    monkeypatch.setattr(keras, "__version__", "3.10.0")
    hooks.check_keras_version()
    monkeypatch.setattr(keras, "__version__", "3.16.0.dev2026102704")
    hooks.check_keras_version()


def test_the_docs_table_is_current():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "tools", "gen_hooks_doc.py"),
                           "--check"], cwd=tempfile.gettempdir(), capture_output=True, text=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"), timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
