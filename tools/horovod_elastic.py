"""Runs Horovod's elastic integration scenarios with bpslaunch instead of horovodrun.

    python tools/horovod_elastic.py HOROVOD [--only NAME ...] [--retrace-on-reset]
                                    [--tf-keras DIR]

HOROVOD is a Horovod checkout (or a git directory of one: its HEAD is read).
Each scenario of Horovod's test/integration/elastic_common.py runs Horovod's
own training script, test/integration/data/elastic_tensorflow2_main.py,
unchanged, under ``bpslaunch`` with the options horovodrun gets there, and
the results (the JSON lines rank 0 writes per epoch) are checked against the
same assertions. The script's ``import horovod.tensorflow as hvd`` is served
by a two-line alias package this tool writes (``horovod.tensorflow`` ->
``bps_tf``), placed first on PYTHONPATH; nothing of Horovod is imported.

The discovery script is built the way elastic_common.py builds it: a bash
script that counts the lines of the log file (the epochs rank 0 has logged)
and prints the hosts of the schedule for that count.

What the tool adapts, and why:
- horovodrun's in-process ``_run_elastic`` raises RuntimeError; bpslaunch is
  a process: "raises RuntimeError('... exited with non-zero status')"
  becomes "bpslaunch exits non-zero with 'job failed' in its last line", and
  the reset limit's message is checked in bpslaunch's output
  ("the number of resets exceeded the limit of 1").
- The tests patch Horovod's discovery period (0.01 s) and, where they patch
  ELASTIC_TIMEOUT_SECS to 1, its elastic timeout: here
  ``--discovery-interval`` and ``--elastic-timeout 1`` say the same.
- test_min_hosts_timeout passes ``np=4``, a keyword _run does not take (a
  TypeError there); it is read as what it means, -np 4.
- bpslaunch also gets ``--servers 1`` and a ``--timeout`` (a hang guard).

``--retrace-on-reset`` runs a copy of the script whose reset callback makes
its ``tf.function`` again (for a bps_tf whose graphs do not yet outlive a
membership); without it, the script runs as Horovod ships it.

``keras_mnist_example`` and ``mnist_example`` run Horovod's
examples/elastic/tensorflow2 scripts, unchanged, on tf_keras (``--tf-keras``)
with ``bpslaunch -np 2 --min-np 1 --max-np 2``, SIGKILL worker 1 once
training runs, and expect the job to finish (exit 0). MNIST comes from a
generated stand-in (see STAND_IN): the machine may have no network.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SCRIPT = "test/integration/data/elastic_tensorflow2_main.py"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ALIAS = {  # module -> what it holds
    "horovod/__init__.py": "",
    "horovod/tensorflow/__init__.py":
        "from bps_tf import *  # noqa: F401,F403\nfrom bps_tf import elastic  # noqa: F401\n",
    "horovod/tensorflow/keras/__init__.py":
        "from bps_tf.keras import *  # noqa: F401,F403\nfrom bps_tf.keras import elastic  # noqa\n",
}


def read_script(horovod: str, name: str = SCRIPT) -> str:
    path = os.path.join(horovod, name)
    if os.path.exists(path):
        with open(path) as f:
            return f.read()
    return subprocess.run(["git", "-C", horovod, "show", f"HEAD:{name}"], check=True,
                          capture_output=True, text=True).stdout


def discovery_script(path: str, logfile: str, schedule) -> None:
    """bash: the epoch is the log file's line count; print that epoch's hosts."""
    lines = ["#!/bin/bash", "epoch=0",
             f'if [ -f {logfile} ]; then epoch=$(wc -l < {logfile} | tr -d "[:space:]"); fi']
    for i, (epoch, hosts) in enumerate(schedule):
        echo = "; ".join(f'echo "{h}"' for h in hosts) or "true"
        if len(schedule) == 1:
            lines.append(echo)
        elif epoch is None:
            lines += ["else", f"  {echo}", "fi"]
        else:
            lines += [f'{"if" if i == 0 else "elif"} [ "$epoch" == "{epoch}" ]; then', f"  {echo}"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(path, 0o755)


class Failed(AssertionError):
    pass


def equal(got, want, what):
    if got != want:
        raise Failed(f"{what}: {got!r} != {want!r}")


def run(ctx, schedule=None, exit_schedule=None, exit_mode="exception", num_proc=2,
        min_num_proc=2, max_num_proc=4, hosts=None, reset_limit=None, cooldown_range=None,
        epoch_wait=None, epochs=None, elastic_timeout=None):
    """One bpslaunch run with the options elastic_common's _run gives
    horovodrun; returns (exit code, output, results)."""
    work = tempfile.mkdtemp(prefix="hvd_elastic_", dir=ctx.tmp)
    logfile = os.path.join(work, "log")
    discovery = os.path.join(work, "discover.sh")
    discovery_script(discovery, logfile, schedule or [(None, hosts.split(","))])
    cmd = [sys.executable, "-m", "bps_tf.launch", "-np", str(num_proc),
           "--min-num-proc", str(min_num_proc), "--log-level", "DEBUG"]
    if hosts is not None:
        cmd += ["-H", hosts]
    else:
        cmd += ["--host-discovery-script", discovery, "--max-num-proc", str(max_num_proc)]
    if reset_limit is not None:
        cmd += ["--reset-limit", str(reset_limit)]
    if cooldown_range is not None:
        cmd += ["--blacklist-cooldown-range", str(cooldown_range[0]), str(cooldown_range[1])]
    cmd += ["--discovery-interval", str(ctx.interval), "--servers", "1",
            "--timeout", str(ctx.timeout)]
    if elastic_timeout is not None:
        cmd += ["--elastic-timeout", str(elastic_timeout)]
    cmd += [sys.executable, ctx.script, "--logfile", logfile]
    if schedule:
        cmd += ["--discovery-schedule", json.dumps(schedule)]
    if epoch_wait:
        cmd += ["--epoch-wait", json.dumps(epoch_wait)]
    if epochs:
        cmd += ["--epochs", json.dumps(epochs)]
    if exit_schedule:
        cmd += ["--exit-schedule", json.dumps(exit_schedule), "--exit-mode", exit_mode]
    started = time.time()
    proc = subprocess.run(cmd, env=ctx.env, capture_output=True, text=True, cwd=work,
                          timeout=ctx.timeout + 60)
    out = proc.stdout + proc.stderr
    with open(os.path.join(work, "bpslaunch.log"), "w") as f:
        f.write(" ".join(cmd) + "\n" + out)
    results = []
    if os.path.exists(logfile):
        with open(logfile) as f:
            results = [json.loads(line) for line in f if line.strip()]
    print(f"    bpslaunch exit {proc.returncode} after {time.time() - started:.1f} s; "
          f"{len(results)} result line(s); log: {work}/bpslaunch.log", flush=True)
    return proc.returncode, out, results


def expect_failure(code, out, needle=None):
    if code == 0:
        raise Failed("bpslaunch exited 0; the job should have failed")
    last = [line for line in out.splitlines() if "bpslaunch: job" in line]
    if not last or "job failed" not in last[-1]:
        raise Failed(f"no 'job failed' end line: {last[-1:]}")
    if needle and needle not in out:
        raise Failed(f"bpslaunch's output does not say {needle!r}")


def check_rows(results, rows):
    for i, want in rows:
        for key, value in want.items():
            equal(results[i][key], value, f"results[{i}][{key!r}]")


def hosts_added_and_removed(ctx):
    for slots, num_proc, min_num_proc, max_num_proc in [(2, 2, 2, 4), (1, 1, 1, 2)]:
        schedule = [(0, [f"localhost:{slots}"]),
                    (1, [f"localhost:{slots}", f"127.0.0.1:{slots}"]),
                    (None, [f"127.0.0.1:{slots}"])]
        code, _, results = run(ctx, schedule, num_proc=num_proc, min_num_proc=min_num_proc,
                               max_num_proc=max_num_proc)
        equal(code, 0, "bpslaunch exit code")
        equal(len(results), 3, "result lines")
        check_rows(results, [
            (0, {"start_rank": 0, "size": slots, "hostname": "localhost"}),
            (1, {"start_rank": 0, "size": slots * 2, "hostname": "localhost"}),
            (2, {"start_rank": slots, "size": slots, "hostname": "127.0.0.1", "rendezvous": 3})])


FAILURE_ROWS = [(0, {"start_rank": 0, "size": 4, "rendezvous": 1}),
                (1, {"start_rank": 2, "size": 2, "rendezvous": 2}),
                (2, {"start_rank": 2, "size": 2, "rendezvous": 2})]


def single_rank_failure(ctx):
    for mode in ["exception", "kill"]:
        code, _, results = run(ctx, [(None, ["localhost:2", "127.0.0.1:2"])],
                               exit_schedule={str((1, 0)): [0]}, exit_mode=mode)
        equal(code, 0, f"{mode}: bpslaunch exit code")
        equal(len(results), 3, f"{mode}: result lines")
        check_rows(results, FAILURE_ROWS)


def fault_tolerance_without_scaling(ctx):
    for mode in ["exception", "kill"]:
        code, _, results = run(ctx, hosts="localhost:2,127.0.0.1:2",
                               exit_schedule={str((1, 0)): [0]}, exit_mode=mode)
        equal(code, 0, f"{mode}: bpslaunch exit code")
        equal(len(results), 3, f"{mode}: result lines")
        check_rows(results, FAILURE_ROWS)


def all_ranks_failure(ctx):
    code, out, _ = run(ctx, [(None, ["localhost:2", "127.0.0.1:2"])],
                       exit_schedule={str((1, 0)): [0, 1, 2, 3]})
    expect_failure(code, out)


def all_hosts_blacklisted(ctx):
    code, out, _ = run(ctx, [(None, ["localhost:2", "127.0.0.1:2"])],
                       exit_schedule={str((1, 0)): [0, 2]})
    expect_failure(code, out)


def min_hosts_timeout(ctx):
    code, out, _ = run(ctx, [(None, ["localhost:2", "127.0.0.1:2"])],
                       exit_schedule={str((1, 0)): [0]}, num_proc=4, min_num_proc=4,
                       elastic_timeout=1)
    expect_failure(code, out)


def reset_limit(ctx):
    schedule = [(0, ["localhost:2"]), (1, ["localhost:2", "127.0.0.1:2"]),
                (None, ["127.0.0.1:2"])]
    code, out, _ = run(ctx, schedule, reset_limit=1, elastic_timeout=1)
    expect_failure(code, out, "the number of resets exceeded the limit of 1")
    code, _, results = run(ctx, schedule, reset_limit=2, elastic_timeout=1)
    equal(code, 0, "reset limit 2: bpslaunch exit code")
    equal(len(results), 3, "reset limit 2: result lines")


def resurrecting_blacklisted_hosts(ctx):
    code, _, results = run(ctx, [(None, ["localhost:2", "127.0.0.1:2"])],
                           exit_schedule={str((1, 0)): [3], str((3, 0)): [3]},
                           epoch_wait=0.25, epochs=5, cooldown_range=[1, 2])
    equal(code, 0, "bpslaunch exit code")
    equal(len(results), 5, "result lines")
    check_rows(results, [(0, {"start_rank": 0, "size": 4, "rendezvous": 1}),
                         (1, {"start_rank": 0, "size": 2, "rendezvous": 2}),
                         (2, {"start_rank": 0, "size": 2, "rendezvous": 2}),
                         (4, {"start_rank": 0, "size": 2, "rendezvous": 2})])


# Horovod's elastic examples, on tf_keras (TF_USE_LEGACY_KERAS=1), launched
# the default way (-np 2 --min-np 1 --max-np 2: a lost worker is replaced);
# worker 1 is SIGKILLed once training runs. No network here: MNIST's loader
# is served generated arrays (8x8 images of 10 classes) by a sitecustomize
# this tool writes, so the unchanged scripts train without a download.
EXAMPLES = {"keras_mnist_example": "examples/elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py",
            "mnist_example": "examples/elastic/tensorflow2/tensorflow2_mnist_elastic.py"}
STAND_IN = """
import importlib.abc, importlib.machinery, sys
import numpy as np

def load_data(path="mnist.npz"):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 6000).astype("uint8")
    images = (rng.integers(0, 64, (6000, 8, 8)) + 19 * labels[:, None, None]).astype("uint8")
    return (images[:5000], labels[:5000]), (images[5000:], labels[5000:])

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if not name.endswith("datasets.mnist"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            module.load_data = load_data
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Finder())
"""


def example_killed(ctx, name):
    if not ctx.tf_keras:
        raise Failed("needs --tf-keras DIR (a folder holding tf_keras for this TensorFlow)")
    work = tempfile.mkdtemp(prefix=name + "_", dir=ctx.tmp)
    script = os.path.join(work, os.path.basename(EXAMPLES[name]))
    with open(script, "w") as f:
        f.write(read_script(ctx.horovod, EXAMPLES[name]))
    site = os.path.join(work, "site")
    os.makedirs(site)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(STAND_IN)
    env = dict(ctx.env, TF_USE_LEGACY_KERAS="1")
    env["PYTHONPATH"] = os.pathsep.join([site, ctx.tf_keras, env["PYTHONPATH"]])
    cmd = [sys.executable, "-m", "bps_tf.launch", "-np", "2", "--min-np", "1", "--max-np", "2",
           "--servers", "1", "--timeout", str(ctx.timeout), sys.executable, script]
    log_path = os.path.join(work, "bpslaunch.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
        killed = kill_worker_once_training(proc, log_path, ctx.timeout)
        code = proc.wait(timeout=ctx.timeout + 60)
    with open(log_path) as f:
        out = f.read()
    print(f"    bpslaunch exit {code}; worker 1 killed: {killed}; log: {log_path}", flush=True)
    equal(killed, True, "worker 1 was SIGKILLed while training")
    equal(code, 0, "bpslaunch exit code")
    if "was killed by signal SIGKILL; elastic: the job goes on" not in out:
        raise Failed("bpslaunch did not report the killed worker")


def kill_worker_once_training(proc, log_path, timeout):
    """SIGKILLs the worker labelled [worker 1] after both workers trained a while."""
    import signal
    import psutil
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        with open(log_path) as f:
            text = f.read()
        # Keras' epoch lines or the custom loop's step lines, after the first membership.
        if text.count("[worker 0] Epoch 2/") or text.count("Step #20"):
            for child in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if child.environ().get("BYTEPS_LAUNCH_ID") == "1":
                        os.kill(child.pid, signal.SIGKILL)
                        return True
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
        time.sleep(0.5)
    return False


def keras_mnist_example(ctx):
    example_killed(ctx, "keras_mnist_example")


def mnist_example(ctx):
    example_killed(ctx, "mnist_example")


SCENARIOS = [hosts_added_and_removed, single_rank_failure, fault_tolerance_without_scaling,
             all_ranks_failure, all_hosts_blacklisted, min_hosts_timeout, reset_limit,
             resurrecting_blacklisted_hosts, keras_mnist_example, mnist_example]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("horovod", help="a Horovod checkout, or a git directory of one")
    parser.add_argument("--only", nargs="*", default=None, help="scenario names to run")
    parser.add_argument("--retrace-on-reset", action="store_true")
    parser.add_argument("--discovery-interval", dest="interval", type=float, default=0.1)
    parser.add_argument("--timeout", type=int, default=900, help="per bpslaunch run")
    parser.add_argument("--keep", default=None, help="folder for the runs' files")
    parser.add_argument("--tf-keras", default=None,
                        help="a folder holding tf_keras (pip install --target DIR "
                             "tf_keras==<TensorFlow's x.y>.*), for the Keras examples")
    args = parser.parse_args()
    args.tmp = args.keep or tempfile.mkdtemp(prefix="hvd_elastic_runs_")
    os.makedirs(args.tmp, exist_ok=True)
    alias = os.path.join(args.tmp, "alias")
    for name, text in ALIAS.items():
        os.makedirs(os.path.dirname(os.path.join(alias, name)), exist_ok=True)
        with open(os.path.join(alias, name), "w") as f:
            f.write(text)
    source = read_script(args.horovod)
    if args.retrace_on_reset:
        marker = "def on_state_reset():\n"
        if marker not in source:
            raise SystemExit("--retrace-on-reset: the script has no on_state_reset()")
        source = source.replace(marker, marker + "    global step\n"
                                "    step = tf.function(step.python_function)\n")
    args.script = os.path.join(args.tmp, "elastic_tensorflow2_main.py")
    with open(args.script, "w") as f:
        f.write(source)
    args.env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    args.env["PYTHONPATH"] = os.pathsep.join(
        p for p in (alias, ROOT, os.environ.get("PYTHONPATH")) if p)
    args.env.pop("TF_CONFIG", None)
    chosen = [s for s in SCENARIOS if not args.only or s.__name__ in args.only]
    failed = 0
    for scenario in chosen:
        started = time.time()
        print(f"{scenario.__name__}:", flush=True)
        try:
            scenario(args)
            print(f"  PASSED ({time.time() - started:.0f} s)", flush=True)
        except Failed as exc:
            failed += 1
            print(f"  FAILED ({time.time() - started:.0f} s): {exc}", flush=True)
    print(f"{len(chosen) - failed} of {len(chosen)} scenarios passed; files in {args.tmp}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
