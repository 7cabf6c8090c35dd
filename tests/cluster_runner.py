"""Runs a local bps_tf cluster with bpslaunch for tests and collects results."""
import glob
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A job's time limit bounds a hang, not the speed: on a machine that other
# jobs load (2 cores shared), a cluster runs 2-3x slower than alone, while a
# lost tensor fails much sooner through BYTEPS_OP_TIMEOUT and the stall checks.
TIMEOUT_SCALE = float(os.environ.get("BPS_TEST_TIMEOUT_SCALE", "2"))


def launch(num_workers, num_servers, script_args, env=None, timeout=120):
    """Runs `bpslaunch -np N --servers S python <script_args>`; returns the
    CompletedProcess (output captured)."""
    full_env = dict(os.environ)
    full_env.pop("TF_CONFIG", None)
    full_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    full_env.update(env or {})
    timeout = int(timeout * TIMEOUT_SCALE)
    if "BYTEPS_OP_TIMEOUT" in (env or {}):
        # The tests' op timeouts are hang guards too ("a lost tensor fails
        # instead of hanging"): a trace that takes a minute on a loaded
        # machine is not a lost tensor.
        full_env["BYTEPS_OP_TIMEOUT"] = str(int(float(env["BYTEPS_OP_TIMEOUT"]) * TIMEOUT_SCALE))
    # The launcher's own timeout stops the job in order (and names it) before
    # subprocess.run's hard limit would kill the launcher.
    cmd = [sys.executable, "-m", "bps_tf.launch", "-np", str(num_workers), "--servers",
           str(num_servers), "--timeout", str(max(timeout - 15, 10)), sys.executable] + list(script_args)
    # Run from a neutral directory: `python -m` puts the working directory on
    # sys.path, and the source tree must not shadow the installed package.
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout,
                          cwd=tempfile.gettempdir())


def results(out_dir):
    """rank -> the JSON a worker wrote."""
    found = {}
    for path in glob.glob(os.path.join(out_dir, "rank*.json")):
        with open(path) as f:
            who = os.path.basename(path)[4:-5]
            found[int(who) if who.isdigit() else who] = json.load(f)
    return found


def run_checks(num_workers, num_servers, script, out_dir, env=None, timeout=300):
    """Runs a worker script that records its checks (tests/workers/
    check_record.py) in ``out_dir``; returns (rank -> results, log,
    bpslaunch exit code) after asserting that every worker wrote results."""
    proc = launch(num_workers, num_servers, [script, out_dir], env=env, timeout=timeout)
    log = (f"bpslaunch exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n"
           f"--- stderr\n{proc.stderr[-5000:]}")
    found = results(out_dir)
    assert sorted(found) == list(range(num_workers)), "missing worker results\n" + log
    return found, log, proc.returncode


def passed_details(found, log, name):
    """rank -> the detail each rank recorded for check ``name``, after
    asserting that every rank ran it and it passed (a rank that stopped at
    an earlier failure is reported with every failure recorded)."""
    details = {}
    for rank, data in sorted(found.items()):
        result = data["checks"].get(name)
        if result is None:
            failed = [(r, n, c["detail"]) for r, d in sorted(found.items())
                      for n, c in d["checks"].items() if not c["ok"]]
            raise AssertionError(f"rank {rank} did not reach {name}; failures: {failed}\n{log}")
        assert result["ok"], f"rank {rank}: {name} failed:\n{result['detail']}\n{log}"
        details[rank] = result["detail"]
    return details
