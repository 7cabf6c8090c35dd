#!/usr/bin/env python3
"""The version matrix: bps_tf against the TensorFlow / Keras releases it supports.

For a developer, not CI (each combination installs its own TensorFlow): one
venv per combination, bps_tf installed from this checkout, then the README's
quick start and a smoke subset of the tests (strategy, overlap exactness,
the Keras and Horovod APIs, the TF1 path), all from a folder outside the
checkout. Prints a markdown table and writes JSON; ``--write-docs`` puts the
table into docs/dependencies.md between its markers.

    python tools/compat_matrix.py                       # every combination
    python tools/compat_matrix.py --only tf2.22rc0 --only tf2.16
    python tools/compat_matrix.py --venv-root /work/venvs --reuse

Venvs live under ``--venv-root`` (default ~/.cache/bps_tf/matrix) and are
reused with ``--reuse`` when their TensorFlow and Keras are the ones asked
for (the Keras *distribution* too: a release candidate's keras-nightly is
not keras); bps_tf itself is reinstalled from the checkout every run. Each
combination installs its TensorFlow/Keras pins with requirements-base.txt
(everything but TensorFlow and Keras), so no second Keras distribution is
pulled over the one its TensorFlow brings; a venv whose ``keras`` folder
belongs to two distributions, or to another one than expected, is a failed
row, and each row records the Keras it ran.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "dependencies.md")
BEGIN, END = "<!-- compat-matrix:begin -->", "<!-- compat-matrix:end -->"

# name -> (pip requirements for TensorFlow/Keras, extra environment, what it stands for)
COMBINATIONS = {
    "tf2.16": (["tensorflow-cpu==2.16.2", "numpy<2"], {},
               "the oldest TensorFlow requirements.txt allows, with the Keras pip picks"),
    "tf2.16-keras3.10": (["tensorflow-cpu==2.16.2", "keras==3.10.0", "numpy<2"], {},
                         "the oldest Keras 3 bps_tf supports"),
    "tf2.18": (["tensorflow-cpu==2.18.1"], {}, ""),
    "tf2.20": (["tensorflow-cpu==2.20.0"], {}, ""),
    "tf2.21-keras3.15.1": (["tensorflow-cpu==2.21.0", "keras==3.15.1"], {},
                           "the default of the README (newest releases)"),
    "tf2.21-tf_keras": (["tensorflow-cpu==2.21.0", "keras==3.15.1", "tf_keras==2.21.0"],
                        {"TF_USE_LEGACY_KERAS": "1"}, "Keras 2 (tf_keras)"),
    "tf2.22rc0": (["tensorflow-cpu==2.22.0rc0"], {},
                  "the release candidate, with the keras-nightly it pulls"),
}
# The distribution that must provide the `keras` package (default "keras").
KERAS_DISTRIBUTION = {"tf2.22rc0": "keras-nightly"}
QUICK_START = ["bpslaunch", "-np", "2", "--servers", "1", "python",
               os.path.join(ROOT, "examples", "keras_digits.py")]
TF_KERAS_QUICK_START = ["bpslaunch", "-np", "2", "--servers", "1", "python",
                        os.path.join(ROOT, "examples", "keras_horovod_style.py")]
SMOKE = ["tests/test_strategy.py", "tests/test_overlap_fit.py", "tests/test_api_single.py",
         "tests/test_parity_single.py", "tests/test_tf1_optimizer.py", "tests/test_progress_bar.py"]
TF_KERAS_SMOKE = ["tests/test_tf_keras.py", "tests/test_api_single.py",
                  "tests/test_tf1_optimizer.py"]
# Keras 3 checks: they build a `keras` (Keras 3) model or optimizer and hand it to
# bps_tf.keras, which under TF_USE_LEGACY_KERAS=1 follows tf.keras (tf_keras) as
# Horovod's does; test_tf_keras checks that face.
TF_KERAS_DESELECT = ["test_saved_model_loads_as_plain_class_and_load_model_rewraps",
                     "test_horovod_tf2_scripts_call_optimizer_variables"]


def _run(cmd, env=None, cwd=None, timeout=None, log=None):
    """(exit code, seconds, output tail)."""
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, capture_output=True,
                              text=True)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = 124
        out = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(
            errors="replace") + f"\n(timed out after {timeout} s)"
    if log is not None:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{out}\n")
    return code, time.monotonic() - start, out[-4000:]


def _versions(python):
    """What the venv's Python imports, and which distributions own the
    files of its ``keras`` package (``keras_distributions``)."""
    probe = ("import json, tensorflow as tf, keras, numpy, importlib.metadata as md\n"
             "found = {'tensorflow': tf.__version__, 'keras': keras.__version__, "
             "'numpy': numpy.__version__, 'keras_file': keras.__file__}\n"
             "found['keras_distributions'] = sorted(\n"
             "    [d.metadata['Name'], d.version] for d in md.distributions()\n"
             "    if any(str(f) == 'keras/__init__.py' for f in (d.files or [])))\n"
             "try:\n    import tf_keras\n    found['tf_keras'] = tf_keras.__version__\n"
             "except ImportError:\n    pass\n"
             "print(json.dumps(found))")
    code, _, out = _run([python, "-c", probe], env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    if code != 0:
        return {}
    # The JSON line, wherever a library's log lines on stderr put it.
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    return {}


def keras_problem(found, expected="keras", pinned=None):
    """Why the Keras a venv runs is not the one its combination stands for
    ("" when it is): ``found`` is what :func:`_versions` read."""
    owners = found.get("keras_distributions")
    if owners is None:
        return "no keras could be imported"
    names = sorted({name.lower() for name, _ in owners})
    if len(owners) != 1:
        return (f"the keras package belongs to {len(owners)} distributions "
                f"({', '.join(f'{n} {v}' for n, v in owners)}): one was installed over the "
                f"other; install the TensorFlow first, then requirements-base.txt")
    if names != [expected.lower()]:
        return f"keras comes from {owners[0][0]} {owners[0][1]}, not {expected}"
    if pinned and owners[0][1].replace("-", "") != pinned.replace("-", ""):
        return f"keras {owners[0][1]} is installed, not {pinned}"
    return ""


def _venv(name, requirements, root, reuse, log):
    path = os.path.join(root, name)
    python = os.path.join(path, "bin", "python")
    # Every pinned package must be the one found, not only TensorFlow: a
    # venv of the same TensorFlow with another Keras is another combination.
    pinned = {r.split("==")[0].replace("tensorflow-cpu", "tensorflow"): r.split("==")[1]
              for r in requirements if "==" in r}
    found = _versions(python) if os.path.exists(python) else {}
    same = lambda a, b: (a or "").replace("-", "") == b.replace("-", "")  # noqa: E731  2.22.0-rc0
    expected = KERAS_DISTRIBUTION.get(name, "keras")
    if not (reuse and all(same(found.get(k), v) for k, v in pinned.items())
            and not keras_problem(found, expected, pinned.get("keras"))):
        shutil.rmtree(path, ignore_errors=True)
        code, _, out = _run([sys.executable, "-m", "venv", path], log=log)
        if code != 0:
            raise RuntimeError(f"venv: {out}")
        code, _, out = _run([python, "-m", "pip", "install", "-q", *requirements,
                             "-r", os.path.join(ROOT, "requirements-base.txt"),
                             "-r", os.path.join(ROOT, "requirements-test-tools.txt")],
                            log=log, timeout=1800)
        if code != 0:
            raise RuntimeError(f"pip install of {requirements}: {out}")
    code, _, out = _run([python, "-m", "pip", "install", "-q", "--force-reinstall",
                         "--no-deps", ROOT], log=log, timeout=1800)
    if code != 0:
        raise RuntimeError(f"pip install of bps_tf: {out}")
    return path


def run_one(name, root, reuse, timeout, log):
    requirements, extra_env, _ = COMBINATIONS[name]
    row = {"name": name, "requirements": requirements, "env": extra_env}
    try:
        path = _venv(name, requirements, root, reuse, log)
    except RuntimeError as exc:
        row.update(install="fail", error=str(exc)[-600:])
        return row
    python = os.path.join(path, "bin", "python")
    row["versions"] = _versions(python)
    problem = keras_problem(row["versions"], KERAS_DISTRIBUTION.get(name, "keras"),
                            dict(r.split("==") for r in requirements if "==" in r).get("keras"))
    if problem:
        row.update(install="fail", error=f"not the Keras of {name}: {problem}")
        return row
    env = dict(os.environ, **extra_env, TF_CPP_MIN_LOG_LEVEL="2",
               PATH=os.path.join(path, "bin") + os.pathsep + os.environ.get("PATH", ""))
    env.pop("PYTHONPATH", None)
    tf_keras = "TF_USE_LEGACY_KERAS" in extra_env
    neutral = tempfile.mkdtemp(prefix="bps_tf_matrix_")
    quick = TF_KERAS_QUICK_START if tf_keras else QUICK_START
    code, seconds, out = _run(quick, env=env, cwd=neutral, timeout=timeout, log=log)
    accuracy = [line for line in out.splitlines() if "accuracy" in line][-1:]
    row["quick_start"] = {"exit": code, "seconds": round(seconds, 1),
                          "last": accuracy[0].strip() if accuracy else out.strip()[-300:]}
    smoke = TF_KERAS_SMOKE if tf_keras else SMOKE
    deselect = (["-k", " and ".join(f"not {t}" for t in TF_KERAS_DESELECT)]
                if tf_keras else [])
    code, seconds, out = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *[os.path.join(ROOT, t) for t in smoke], *deselect],
                              env=env, cwd=neutral, timeout=timeout * 6, log=log)
    summary = [line for line in out.splitlines() if " passed" in line or " failed" in line
               or " error" in line][-1:]
    row["smoke"] = {"exit": code, "seconds": round(seconds, 1), "files": smoke,
                    "summary": summary[0].strip() if summary else out.strip()[-300:]}
    shutil.rmtree(neutral, ignore_errors=True)
    return row


def table(rows):
    lines = ["| combination | TensorFlow | Keras | quick start | smoke tests | date |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        versions = row.get("versions", {})
        if row.get("install") == "fail":
            quick = smoke = f"install failed: {row['error'].splitlines()[-1][:120]}"
        else:
            q, s = row["quick_start"], row["smoke"]
            quick = ("pass" if q["exit"] == 0 else f"FAIL (exit {q['exit']})") + \
                    f", {q['seconds']:.0f} s"
            smoke = ("pass" if s["exit"] == 0 else "FAIL") + f": {s['summary']}"
        owners = versions.get("keras_distributions") or []
        keras = versions.get("keras", "?")
        if len(owners) == 1 and owners[0][0].lower() != "keras":
            keras += f" ({owners[0][0]})"    # the distribution that ran, e.g. keras-nightly
        lines.append(f"| {row['name']} | {versions.get('tensorflow', '?')} | {keras} | {quick} | "
                     f"{smoke} | {row.get('date', '')} |")
    return "\n".join(lines)


def write_docs(text):
    with open(DOC) as f:
        doc = f.read()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{DOC} has no {BEGIN} ... {END} markers")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(DOC, "w") as f:
        f.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def _save(path, rows, command):
    """Merges ``rows`` into the JSON at ``path`` (earlier results of the
    combinations not run now stay) and returns the table of all."""
    known = {}
    if os.path.exists(path):
        with open(path) as f:
            known = {r["name"]: r for r in json.load(f).get("rows", [])}
    known.update({r["name"]: r for r in rows})
    merged = [known[n] for n in COMBINATIONS if n in known]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"command": command, "rows": merged}, f, indent=2)
    return table(merged)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=sorted(COMBINATIONS),
                        help="run this combination (repeatable; default: all)")
    parser.add_argument("--venv-root", default=os.path.join(
        os.path.expanduser("~"), ".cache", "bps_tf", "matrix"))
    parser.add_argument("--reuse", action="store_true",
                        help="keep a venv whose TensorFlow is the one asked for")
    parser.add_argument("--timeout", type=int, default=600,
                        help="seconds for the quick start (the smoke tests get 6x)")
    parser.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results",
                                                       "compat_matrix.json"))
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    names = args.only or list(COMBINATIONS)
    os.makedirs(args.venv_root, exist_ok=True)
    log = os.path.join(args.venv_root, "matrix.log")
    date = datetime.date.today().isoformat()
    command = "python tools/compat_matrix.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    rows = []
    for name in names:
        print(f"== {name}", flush=True)
        rows.append(run_one(name, args.venv_root, args.reuse, args.timeout, log))
        rows[-1]["date"] = date
        print(table(rows[-1:]).splitlines()[-1], flush=True)
        # After each combination: a long run stopped half-way keeps what it found.
        text = _save(args.json, rows, command)
    print(text)
    if args.write_docs:
        write_docs(text)
    return 0 if all(r.get("quick_start", {}).get("exit") == 0 and
                    r.get("smoke", {}).get("exit") == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
