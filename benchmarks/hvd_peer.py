"""Horovod 0.28.1 + gloo as a peer in the benchmarks: where its venv is, and
how to run benchmarks/workers/hvd_allreduce.py on loopback (horovodrun
--gloo) and on namespace hosts (horovodrun's own rendezvous server, the
ranks started with the variables horovodrun would set: horovodrun itself
reaches other hosts only through ssh).

Horovod lives in its own venv, benchmarks/.hvd-venv, made by
benchmarks/setup_horovod.sh; it is never a dependency of bps_tf.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import List, Mapping, Optional, Sequence

from benchmarks import common
from benchmarks.common import Host, LOCALHOST, Processes

VENV = common.BENCH_DIR / ".hvd-venv"
PYTHON = VENV / "bin" / "python"
HOROVODRUN = VENV / "bin" / "horovodrun"
WORKER = common.WORKERS_DIR / "hvd_allreduce.py"
SETUP = "benchmarks/setup_horovod.sh"


def column(skipped: bool, tool: str, notes: list) -> bool:
    """Whether a benchmark's Horovod column runs: not when the user skipped it
    (``--no-horovod``) or Horovod cannot run here; the reason goes to
    ``notes`` (and, for the latter, to stderr under the ``tool``'s name)."""
    if skipped:
        notes.append("Horovod skipped (--no-horovod)")
        return False
    reason = unavailable_reason()
    if reason:
        notes.append(f"Horovod column left out: {reason}")
        print(f"{tool}: {reason}; measuring the others", file=sys.stderr, flush=True)
    return reason is None


def unavailable_reason() -> Optional[str]:
    """None when Horovod with gloo can run, else why not (with the fix)."""
    if not PYTHON.exists() or not HOROVODRUN.exists():
        return f"Horovod is not installed: no {HOROVODRUN} (run {SETUP}, about 4 minutes)"
    probe = subprocess.run([str(PYTHON), "-c", "import horovod.tensorflow as h; "
                            "print(int(h.gloo_built()))"],
                           capture_output=True, text=True, timeout=120,
                           env=common.child_env())
    if probe.returncode != 0:
        return (f"Horovod in {VENV} does not import: {probe.stderr.strip()[-300:]} "
                f"(re-run {SETUP})")
    if probe.stdout.strip() != "1":
        return f"Horovod in {VENV} was built without gloo (re-run {SETUP})"
    return None


def run_job(procs: Processes, spec: Path, *, num_workers: int,
            hosts: Sequence[Host] = (), timeout: float = 1800.0,
            env: Optional[Mapping[str, str]] = None) -> List[dict]:
    """Runs one all-reduce job; returns every rank's result file."""
    hosts = list(hosts) or [LOCALHOST] * num_workers
    base = common.child_env(env)
    if all(h == LOCALHOST for h in hosts):
        launcher = procs.start("horovodrun", [str(HOROVODRUN), "-np", str(num_workers), "-H",
                                              f"localhost:{num_workers}", "--gloo",
                                              str(PYTHON), str(WORKER), str(spec)], base)
        procs.wait([launcher], timeout)
        return common.read_results(procs.log_dir, num_workers)
    plan_file = procs.log_dir / "hvd_rendezvous.json"
    host_list = ",".join(f"{h.ip}:1" for h in hosts)
    procs.start("hvd_rendezvous", [str(PYTHON), str(common.WORKERS_DIR / "hvd_rendezvous.py"),
                                   host_list, str(num_workers), str(plan_file)],
                base, hosts[0].prefix, must_succeed=False)
    plan = json.loads(common.wait_for_file(procs, plan_file, timeout=120))
    ranks = []
    for slot in plan["slots"]:
        host = next(h for h in hosts if h.ip == slot["hostname"])
        e = dict(base, HOROVOD_GLOO_RENDEZVOUS_ADDR=hosts[0].ip,
                 HOROVOD_GLOO_RENDEZVOUS_PORT=str(plan["port"]), HOROVOD_CONTROLLER="gloo",
                 HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE="eth0",
                 HOROVOD_HOSTNAME=slot["hostname"],
                 **{f"HOROVOD_{k.upper()}": str(slot[k]) for k in
                    ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")})
        # Horovod 0.28.1 builds its process-set gloo device without HOROVOD_GLOO_IFACE, from
        # the host name, which resolves to 127.0.0.1 here; a UTS namespace per rank whose host
        # name is the host's address makes that device reachable from the other hosts.
        argv = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host.ip,
                str(PYTHON), str(WORKER), str(spec)]
        ranks.append(procs.start(f"hvd_rank{slot['rank']}", argv, e, host.prefix))
    procs.wait(ranks, timeout)
    return common.read_results(procs.log_dir, num_workers)
