"""Every entry of the hook registry, moved the way a release would move it:
a fallback or a clear error (HookError naming it), never an AttributeError
from inside bps_tf, never a hang.

A Keras release is simulated by a copy of the installed Keras in which the
entries' names are renamed (tests/workers/hook_renames.py runs bps_tf with
it first on sys.path): private names and class names everywhere they
appear, public method names where Keras defines and calls them on itself.
A TensorFlow internal is removed from where TensorFlow defines it, then put
back. Three runs, each paid for once:

* every name renamed at once, in one process: each entry is reported
  missing with what its role looked for, BytePSStrategy() refuses with a
  HookError naming the entries it cannot do without, the overlap is off;
  and each TensorFlow entry, moved one at a time, is reported missing;
* the private names renamed (Keras still works): one process trains with
  the fallbacks (the overlap gives the barrier's weights), and the features
  that cannot fall back refuse by name;
* the same in a 2-worker job: fit runs with equal counts, and workers whose
  data differ in length (48 and 80 rows) fail at once, before the first step.
"""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_runner import ROOT, launch  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "workers", "hook_renames.py")
SUFFIX = "_bpsmoved"
TIMEOUT_S = 600
# What the private run renames besides every private name: the epoch
# iterator's base class (its role) and the names read on that private class.
# TensorFlowTrainer: the backend trainer renamed (as Keras 3.16 did), which
# the hooks find by role (it is no entry's name).
PRIVATE_TOO = ("EpochIterator", "data_adapter", "steps_per_epoch", "get_data_adapter",
               "TensorFlowTrainer")


def _installed_keras() -> str:
    spec = importlib.util.find_spec("keras")
    return list(spec.submodule_search_locations)[0]


def _everywhere(name: str, modules) -> bool:
    """Renamed wherever it appears (a private or distinctive name), or only
    where Keras defines it and uses it on itself (a plain word such as
    ``fit``, which other libraries' names share, or the name of one of
    Keras' modules, such as ``data_adapter``)."""
    if name in modules:
        return False
    return name.startswith("_") or "_" in name or name != name.lower()


def renamed_keras(dest: str, names) -> str:
    """A copy of the installed Keras under ``dest`` with ``names`` renamed
    (``name`` -> ``name_bpsmoved``); returns the folder to put on sys.path.
    Module paths in imports are left alone (a module may share a name)."""
    target = os.path.join(dest, "keras")
    shutil.copytree(_installed_keras(), target, ignore=shutil.ignore_patterns("__pycache__"))
    names = sorted(set(names), key=len, reverse=True)
    modules = {os.path.splitext(f)[0] for _, dirs, files in os.walk(target) for f in files + dirs}
    everywhere = [n for n in names if _everywhere(n, modules)]
    own = [n for n in names if not _everywhere(n, modules)]
    rename = lambda m: m.group(0) + SUFFIX  # noqa: E731
    rules = []
    if everywhere:
        rules.append(re.compile(r"(?<![\w])(?:" + "|".join(map(re.escape, everywhere)) +
                                r")(?![\w])"))
    if own:
        words = "|".join(map(re.escape, own))
        rules.append(re.compile(rf"(?<=\bdef )(?:{words})(?=\()|(?<=@)(?:{words})(?=\.)|"
                                rf"(?<=\bself\.)(?:{words})\b|(?<=\bcls\.)(?:{words})\b|"
                                rf"(?<=super\(\)\.)(?:{words})\b"))
    for root, _, files in os.walk(target):
        for file in files:
            if file.endswith(".py"):
                _rewrite(os.path.join(root, file), names, rules, rename)
    return dest


# Module paths in import statements: names renamed there are put back.
_IMPORT_PATH = re.compile(r"^[ \t]*(?:from[ \t]+[\w.]+|import[ \t][^\n]*)", re.M)


def _rewrite(path, names, rules, rename):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not any(name in text for name in names):
        return
    new = text
    for rule in rules:
        new = rule.sub(rename, new)
    if new != text:
        new = _IMPORT_PATH.sub(lambda m: m.group(0).replace(SUFFIX, ""), new)
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)


def _env(path=None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_")) and k != "TF_CONFIG"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    if path:
        env["PYTHONPATH"] = os.pathsep.join([path] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _run_alone(mode, path, out_dir):
    out_dir = str(out_dir)
    proc = subprocess.run([sys.executable, WORKER, mode, str(out_dir)], cwd=tempfile.gettempdir(),
                          env=_env(path), capture_output=True, text=True, timeout=TIMEOUT_S)
    name = os.path.join(out_dir, f"{mode}.json")
    assert proc.returncode == 0 and os.path.exists(name), proc.stdout[-2000:] + proc.stderr[-5000:]
    with open(name) as f:
        return json.load(f), proc.stderr


def _no_attribute_errors(results):
    text = json.dumps(results)
    assert "AttributeError" not in text, text


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """With Keras as installed: every entry's Keras name, and what each
    TensorFlow entry answers when its target is moved."""
    out, _ = _run_alone("tensorflow", None, tmp_path_factory.mktemp("installed"))
    return out["results"]


@pytest.fixture(scope="module")
def names(installed):
    return installed["names"]


@pytest.fixture(scope="module")
def private_keras(tmp_path_factory, names):
    private = [n for n in names.values() if n.startswith("_") and not n.startswith("__")]
    return renamed_keras(str(tmp_path_factory.mktemp("keras_private")), private + list(PRIVATE_TOO))


def test_every_entry_renamed_or_moved_is_reported_and_refused_by_name(tmp_path, installed,
                                                                     names):
    path = renamed_keras(str(tmp_path / "keras_all"), [n for n in names.values() if n])
    out, _ = _run_alone("registry", path, tmp_path)
    results = out["results"]
    assert results["keras_file"].startswith(path), results["keras_file"]
    _no_attribute_errors(results)
    _no_attribute_errors(installed["moved"])
    entries, kinds = dict(results["entries"]), results["kinds"]
    entries.update(installed["moved"])
    assert set(entries) == set(names) == set(kinds)
    for name, outcome in entries.items():
        # Every entry's lookup answers "missing, because ..." (a tf_keras
        # entry: absent here, tf_keras not being installed).
        assert outcome.startswith("ok: ") and "FOUND" not in outcome, (name, outcome)
        assert len(outcome) > len("ok: ") + 10, (name, outcome)
    # The strategy cannot do without what fit, evaluate and predict need:
    # refused, naming them and the versions, never half installed.
    strategy = results["strategy"]
    assert strategy.startswith("HookError: BytePSStrategy needs bps_tf's hook(s)"), strategy
    for name, (kind, policy, group, feature, _) in kinds.items():
        if group == "keras" and policy == "error" and not feature:
            assert name in strategy, (name, strategy)
    assert "Last verified: Keras" in strategy
    assert results["overlap_installed"] == "ok: False", results["overlap_installed"]
    assert any("cross-step overlap is off" in w for w in out["warnings"]), out["warnings"]


def test_private_names_renamed_train_alone_with_fallbacks_and_refuse_by_name(tmp_path,
                                                                            private_keras):
    out, _ = _run_alone("alone", private_keras, tmp_path)
    results = out["results"]
    assert results["keras_file"].startswith(private_keras), results["keras_file"]
    _no_attribute_errors(results)
    # The overlap's private names moved: off, with the barrier's weights.
    assert results["fit"] == "ok: False", results["fit"]
    assert results["same_as_barrier"] == "ok: True", results["same_as_barrier"]
    assert any("cross-step overlap is off" in w and "_iterations" in w
               for w in out["warnings"]), out["warnings"]
    for feature, entry in (("overlapped_apply", "keras.Layer._trainable_variables"),
                           ("sync_batch_norm", "keras.layers.BatchNormalization._moments"),
                           ("distributed_optimizer", "keras.optimizers.Optimizer._backend_"
                                                     "update_step"),
                           ("loss_scaling", "keras.optimizers.LossScaleOptimizer.check_finite")):
        assert results[feature].startswith("HookError: ") and entry in results[feature], \
            (feature, results[feature])


def test_private_names_renamed_in_two_workers_fit_and_different_counts_raise_at_once(
        tmp_path, private_keras):
    proc = launch(2, 1, [WORKER, "workers", str(tmp_path)],
                  env={"PYTHONPATH": _env(private_keras)["PYTHONPATH"]}, timeout=300)
    log = proc.stdout[-3000:] + proc.stderr[-6000:]
    reports = {}
    for rank in (0, 1):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), log
        reports[rank] = json.loads(path.read_text())
    for rank, report in reports.items():
        results = report["results"]
        assert results["keras_file"].startswith(private_keras), results["keras_file"]
        _no_attribute_errors(results)
        assert "keras epoch iterator._num_batches" in results["missing"], results["missing"]
        assert results["equal_counts"].startswith("ok: "), (rank, results["equal_counts"])
        different = results["different_counts"]
        assert different.startswith("ValueError: BytePSStrategy: the workers' data for fit "
                                    "holds different numbers of batches (3, 5, by rank)"), \
            (rank, different)
        # Before the first step: nothing waited for the stall timeout (600 s).
        assert results["different_counts_seconds"] < 60, results["different_counts_seconds"]
        backup = results["backup_and_restore"]
        assert backup.startswith("HookError: BackupAndRestore under a multi-worker "
                                 "BytePSStrategy needs") and "_initial_epoch" in backup, backup
    warnings = reports[0]["warnings"]
    assert any("different counts raise" in w and "_num_batches" in w for w in warnings), warnings
