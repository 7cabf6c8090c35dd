"""tools/compat_matrix.py tells which Keras a combination ran (no venv is
made here: its check of the Keras found, and the requirements it installs)."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _matrix():
    spec = importlib.util.spec_from_file_location("compat_matrix",
                                                  os.path.join(ROOT, "tools", "compat_matrix.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_keras_a_combination_ran_is_checked_not_assumed():
    matrix = _matrix()
    nightly = [["keras-nightly", "3.16.0.dev2026102704"]]
    assert matrix.keras_problem({"keras_distributions": nightly}, "keras-nightly") == ""
    # What pip did to a release candidate's venv: keras installed over keras-nightly.
    mixed = matrix.keras_problem({"keras_distributions": [["keras", "3.15.1"]] + nightly},
                                 "keras-nightly")
    assert "belongs to 2 distributions (keras 3.15.1, keras-nightly" in mixed, mixed
    assert "requirements-base.txt" in mixed
    assert "not keras-nightly" in matrix.keras_problem(
        {"keras_distributions": [["keras", "3.15.1"]]}, "keras-nightly")
    assert "not 3.10.0" in matrix.keras_problem({"keras_distributions": [["keras", "3.15.1"]]},
                                                "keras", "3.10.0")
    assert matrix.keras_problem({}, "keras") == "no keras could be imported"
    assert matrix.KERAS_DISTRIBUTION["tf2.22rc0"] == "keras-nightly"
    table = matrix.table([{"name": "tf2.22rc0", "install": "ok",
                           "versions": {"tensorflow": "2.22.0-rc0", "keras": "3.16.0.dev1",
                                        "keras_distributions": [["keras-nightly", "3.16.0.dev1"]]},
                           "quick_start": {"exit": 0, "seconds": 1.0},
                           "smoke": {"exit": 0, "summary": "1 passed"}}])
    assert "| 3.16.0.dev1 (keras-nightly) |" in table, table


def test_requirements_for_a_pre_release_tensorflow_bring_no_keras_nor_tensorflow():
    with open(os.path.join(ROOT, "requirements-base.txt")) as f:
        base = [line.split(">")[0].split("=")[0].strip().lower() for line in f
                if line.strip() and not line.startswith("#")]
    assert base and not [p for p in base if p.startswith(("keras", "tensorflow", "tf-", "-r"))]
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        text = f.read()
    assert "-r requirements-base.txt" in text and "keras>=3.10" in text
