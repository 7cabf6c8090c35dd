"""The control plane's cost as a job grows: forming, the first sum, a
membership change, and what the scheduler, a server and a worker hold.

    python benchmarks/control_plane.py                           # 16, 64, 256 workers
    python benchmarks/control_plane.py --sizes 256:32 --elastic-at 256
    python benchmarks/control_plane.py --sizes 16:2,64:8,256:32,384:48   # if the machine holds

Every size is one job on this machine's loopback with the numpy path (no
TensorFlow): a scheduler process of its own (so its CPU and memory are its
alone; bpslaunch runs it inside server 0), S servers and N workers
(benchmarks/workers/scale_worker.py: each round 16 x 1 KiB + 1 MiB, every sum
checked, one round per --interval seconds). Measured:

* start: from launching the first process until every worker had imported
  numpy and bps_tf (Python's cost, not the control plane's); its floor is
  the CPU seconds of those starts over the cores: no control plane forms
  the job sooner on this machine;
* form: from launching the first process until every worker's init()
  returned; "form after last" is the control plane's own part: from the
  moment the last worker called init() (its HELLO) until every worker was
  welcomed and connected to every server;
* first sum: from the last init() returning until every worker had its
  first round's sums;
* steady state, over --steady seconds of rounds: the scheduler's CPU (% of
  one core: heartbeats and their acks), and per process kind the file
  descriptors, sockets, threads and memory (PSS: shared pages split between
  their users, so the numbers add up);
* membership change (elastic job, --elastic-at N): one worker is SIGKILLed
  and, as bpslaunch does when its child dies, reported to the scheduler at
  once over the launcher's link (--no-report: not reported, as for a hung
  worker or a job without bpslaunch; then the scheduler's BYTEPS_TIMEOUT,
  --loss-timeout here, dominates "detect"); "detect" is until the
  survivors' operations fail, "rejoin" from there
  until every survivor's restart() returned (the new membership formed),
  "reform" until every survivor had its next sum (declaring the tensors
  again and one round of data).

Prints a table, writes benchmarks/results/control_plane.json. The machine's
load (uptime) is recorded beside every size. As root the scheduler (nice -10),
the servers (nice -5) and this process, which starts them all and stands for
the cluster's manager and bpslaunch (nice -10), run before the workers: on
real machines they have CPUs of their own, and on 2 shared cores a starved
scheduler misses heartbeats. Every process stays in this one's session, so
that the nice values count (with autogroups, sessions share the CPU first).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.common import median  # noqa: E402
from bps_tf.launch.control import SchedulerLink  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
WORKER = str(common.WORKERS_DIR / "scale_worker.py")
CORES = os.cpu_count() or 1


# ------------------------------------------------------------------ /proc
def cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / TICK   # utime + stime


def holdings(pid: int) -> Dict[str, float]:
    """Descriptors, sockets, threads and memory (MiB) of one process."""
    out = {"fds": float("nan"), "sockets": float("nan"), "threads": float("nan"),
           "rss_mib": float("nan"), "pss_mib": float("nan")}
    try:
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        out["fds"] = len(links)
        out["sockets"] = sum(1 for t in links if t.startswith("socket:"))
        out["threads"] = len(os.listdir(f"/proc/{pid}/task"))
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, value = line.split(":", 1)
                if key in ("Rss", "Pss"):
                    out[key.lower() + "_mib"] = int(value.split()[0]) / 1024
    except (OSError, ValueError):
        pass
    return out


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


# ------------------------------------------------------------------ one job
def wait_files(procs: common.Processes, directory: Path, stem: str, count: int,
               timeout: float) -> float:
    """Waits until `count` files DIR/stem.* exist; returns when (time.time())."""
    deadline = time.monotonic() + timeout
    while True:
        have = sum(1 for n in os.listdir(directory) if n.startswith(stem + "."))
        if have >= count:
            return time.time()
        procs.check()
        if time.monotonic() > deadline:
            raise common.JobFailed(f"only {have} of {count} workers reached '{stem}' within "
                                   f"{timeout:.0f} s")
        time.sleep(0.05)


def pump(link, seconds: float) -> None:
    """Waits ``seconds``; the launcher's link does its I/O (its handshake,
    its reports) only while it is read, as bpslaunch reads it in its loop."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if link is None:
            time.sleep(max(0.0, end - time.monotonic()))
        else:
            link.receive(50)


def run_size(n: int, s: int, args, elastic: bool) -> dict:
    result = {"workers": n, "servers": s, "elastic": elastic, "load_before": load()}
    with common.processes(keep_logs=args.keep_logs) as procs:
        out = procs.log_dir / "out"
        out.mkdir()
        spec = common.write_spec(procs.log_dir, {"out_dir": str(out), "interval_s": args.interval})
        port = common.free_port()
        env = {"BYTEPS_JOB_TOKEN": secrets.token_hex(16), "DMLC_NUM_WORKER": str(n),
               "DMLC_NUM_SERVER": str(s), "DMLC_PS_ROOT_URI": common.LOOPBACK,
               "DMLC_PS_ROOT_PORT": str(port), "DMLC_NODE_HOST": common.LOOPBACK,
               "BYTEPS_BIND_HOST": common.LOOPBACK, "BYTEPS_RENDEZVOUS_TIMEOUT": "900"}
        if elastic:
            env.update({"BYTEPS_ELASTIC": "1", "BYTEPS_ELASTIC_MAX_WORKERS": str(n),
                        "BYTEPS_TIMEOUT": str(args.loss_timeout)})
        base = common.child_env(env)
        server_argv = [common.PYTHON, "-m", "bps_tf.server"]
        # Priorities as the module's docstring says. Each child gets its nice
        # value before it starts a thread (Linux keeps one per thread) and
        # stays in this session: with autogroups a scheduler in a session of
        # its own got a 289th of the machine whatever its nice, and read the
        # heartbeats seconds late (docs/scaling.md).
        priority = bool(args.priority and os.geteuid() == 0)
        nice = {"scheduler": -10, "server": -5, "worker": 0} if priority else {}
        if priority:
            os.setpriority(os.PRIO_PROCESS, 0, -10)
        t_launch = time.time()
        ready = procs.log_dir / "scheduler.port"
        sched = procs.start("scheduler", server_argv,
                            dict(base, DMLC_ROLE="scheduler", BYTEPS_READY_FILE=str(ready)),
                            nice=nice.get("scheduler"), own_session=False)
        common.wait_for_file(procs, ready)
        print(f"  scheduler pid {sched.popen.pid}, logs in {procs.log_dir}", flush=True)
        servers = [procs.start(f"server{i}", server_argv,
                               dict(base, DMLC_ROLE="server", BYTEPS_SERVER_ID=str(i),
                                    BYTEPS_SERVER_PORT="0"), nice=nice.get("server"),
                               own_session=False)
                   for i in range(s)]
        # Started by 16 threads, as a cluster's manager starts its pods: one
        # after another, each start waited for its child to reach exec, which
        # took 70-90 ms on 2 cores among those already importing (20-25 s of
        # "start" at 256 + 32, this process's cost, not Python's or bps_tf's).
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            workers = list(pool.map(lambda r: procs.start(
                f"worker{r}", [common.PYTHON, WORKER, str(spec)],
                dict(base, DMLC_ROLE="worker", DMLC_WORKER_ID=str(r), BYTEPS_LAUNCH_ID=str(r)),
                nice=nice.get("worker"), own_session=False, from_thread=True), range(n)))
        result["priority"] = priority
        result["launch_s"] = time.time() - t_launch
        wait_files(procs, out, "first", n, args.form_timeout)
        result["scheduler_cpu_s_to_first_sum"] = cpu_seconds(sched.popen.pid)
        result["servers_cpu_s_to_first_sum"] = sum(cpu_seconds(c.popen.pid) for c in servers)
        time.sleep(args.settle)
        pids = {"scheduler": [sched.popen.pid], "server": [c.popen.pid for c in servers],
                "worker": [c.popen.pid for c in workers]}
        # bpslaunch's link, opened as bpslaunch opens it: before anything is lost.
        link = SchedulerLink(port, base) if elastic and args.report else None
        before = {k: [cpu_seconds(p) for p in v] for k, v in pids.items()}
        t0 = time.monotonic()
        pump(link, args.steady)
        window = time.monotonic() - t0
        after = {k: [cpu_seconds(p) for p in v] for k, v in pids.items()}
        for kind, plist in pids.items():
            cpu = [100 * (b - a) / window for a, b in zip(before[kind], after[kind])]
            held = [holdings(p) for p in plist]
            result[kind] = {"cpu_pct_mean": sum(cpu) / len(cpu), "cpu_pct_max": max(cpu),
                            **{f"{key}_max": max(h[key] for h in held) for key in held[0]},
                            **{f"{key}_median": median(h[key] for h in held) for key in held[0]}}
        result["load_steady"] = load()
        if elastic:
            victim = workers[-1]
            victim.must_succeed = False
            survivors = {k: [p for p in v if p != victim.popen.pid] for k, v in pids.items()}
            cpu_before = {k: sum(cpu_seconds(p) for p in v) for k, v in survivors.items()}
            t_kill = time.time()
            os.killpg(victim.popen.pid, signal.SIGKILL)
            if link is not None:   # what bpslaunch does when its child dies
                victim.popen.wait()
                link.lost(str(n - 1), f"worker{n - 1} was killed by signal SIGKILL")
                pump(link, 1.0)
            result["t_kill"] = t_kill
            result["reported"] = link is not None
            wait_files(procs, out, "after", n - 1, args.form_timeout)
            # CPU seconds each kind spent from the kill until every survivor had
            # its next sum: on 2 shared cores, what the change costs.
            result["change_cpu_s"] = {k: sum(cpu_seconds(p) for p in v) - cpu_before[k]
                                      for k, v in survivors.items()}
            result["change_wall_s"] = time.time() - t_kill
            if link is not None:
                link.close()
        (out / "stop").touch()
        procs.wait(workers if not elastic else workers[:-1], args.form_timeout)
        procs.wait([sched] + servers, 120)
        records = [json.loads((out / f"worker{r}.json").read_text())
                   for r in range(n - (1 if elastic else 0))]
    result["load_after"] = load()
    return summarize(result, records, t_launch)


def summarize(result: dict, records: List[dict], t_launch: float) -> dict:
    last_init = max(r["init_end"] for r in records)
    result["start_s"] = max(r["imported"] for r in records) - t_launch
    result["form_s"] = last_init - t_launch
    result["form_after_last_s"] = last_init - max(r["init_start"] for r in records)
    result["first_sum_s"] = max(r["rounds"][0][1] for r in records) - last_init
    # A round's critical path: from the last worker's start to the last end
    # (the workers pace their rounds each on its own clock), over the rounds
    # of the first membership, the first one (declarations) left out.
    first = [r["rounds"][:len(r["rounds"]) - (1 if r["changes"] else 0)] for r in records]
    if records[0]["changes"]:
        t_change = min(c["failed_round_start"] for r in records for c in r["changes"])
        first = [[x for x in rounds if x[1] < t_change] for rounds in first]
    k = min(len(x) for x in first)
    steady = [max(x[i][1] for x in first) - max(x[i][0] for x in first) for i in range(1, k)]
    result["round_ms_median"] = 1000 * median(steady)
    # CPU seconds of all workers together: Python's start, init(), the first round.
    result["workers_cpu_s_import"] = sum(r["cpu_import"] for r in records)
    result["workers_cpu_s_init"] = sum(r["cpu_init"] - r["cpu_import"] for r in records)
    result["workers_cpu_s_first_round"] = sum(r["cpu_first"] - r["cpu_init"] for r in records)
    result["rounds_checked"] = sum(len(r["rounds"]) for r in records)
    if "t_kill" in result:
        changes = [r["changes"][0] for r in records]
        result["detect_s"] = median(c["seen"] - result["t_kill"] for c in changes)
        result["reform_s"] = max(c["next_sum"] for c in changes) - max(c["seen"] for c in changes)
        # Until every survivor's restart() returned: the new membership formed.
        result["rejoin_s"] = max(c["rejoined"] for c in changes) - max(c["seen"] for c in changes)
        result["change_s"] = max(c["next_sum"] for c in changes) - result["t_kill"]
        result["size_after"] = sorted({c["size"] for c in changes})
        # CPU seconds of all survivors together: restart() (shutdown and a
        # new init()), then declaring again and the first round after it.
        result["workers_cpu_s_restart"] = sum(c["cpu_rejoined"] - c["cpu_seen"] for c in changes)
        result["workers_cpu_s_next_round"] = sum(c["cpu_next_sum"] - c["cpu_rejoined"]
                                                 for c in changes)
    return result


# ------------------------------------------------------------------ main
ROWS = (("processes", lambda r: r["workers"] + r["servers"] + 1),
        ("start s", lambda r: r["start_s"]),
        ("form s", lambda r: r["form_s"]),
        ("form after last s", lambda r: r["form_after_last_s"]),
        ("first sum s", lambda r: r["first_sum_s"]),
        ("round ms", lambda r: r["round_ms_median"]),
        ("CPU s: workers' start", lambda r: r["workers_cpu_s_import"]),
        # Forming cannot take less on this machine, whatever the control plane does.
        ("start floor s (that CPU / the cores)", lambda r: r["workers_cpu_s_import"] / CORES),
        ("CPU s: workers' init()", lambda r: r["workers_cpu_s_init"]),
        ("CPU s: workers' first round", lambda r: r["workers_cpu_s_first_round"]),
        ("CPU s: servers until first sum", lambda r: r["servers_cpu_s_to_first_sum"]),
        ("CPU s: scheduler until first sum", lambda r: r["scheduler_cpu_s_to_first_sum"]),
        ("scheduler CPU %", lambda r: r["scheduler"]["cpu_pct_mean"]),
        ("scheduler PSS MiB", lambda r: r["scheduler"]["pss_mib_max"]),
        ("scheduler fds / sockets", lambda r: f"{r['scheduler']['fds_max']:.0f} / "
                                               f"{r['scheduler']['sockets_max']:.0f}"),
        ("server CPU % (mean)", lambda r: r["server"]["cpu_pct_mean"]),
        ("server fds / sockets (max)", lambda r: f"{r['server']['fds_max']:.0f} / "
                                                  f"{r['server']['sockets_max']:.0f}"),
        ("server PSS MiB (max)", lambda r: r["server"]["pss_mib_max"]),
        ("worker fds / sockets (max)", lambda r: f"{r['worker']['fds_max']:.0f} / "
                                                  f"{r['worker']['sockets_max']:.0f}"),
        ("worker threads (max)", lambda r: r["worker"]["threads_max"]),
        ("worker PSS MiB (median)", lambda r: r["worker"]["pss_mib_median"]),
        ("change: detect s", lambda r: r.get("detect_s", float("nan"))),
        ("change: rejoin s", lambda r: r.get("rejoin_s", float("nan"))),
        ("change: reform s (to the next sum)", lambda r: r.get("reform_s", float("nan"))),
        ("change: kill to sum s", lambda r: r.get("change_s", float("nan"))),
        ("change: CPU s workers' restart() / next round",
         lambda r: f"{r['workers_cpu_s_restart']:.1f} / {r['workers_cpu_s_next_round']:.1f}"
         if "workers_cpu_s_restart" in r else "-"),
        ("change: CPU s workers / servers / scheduler",
         lambda r: " / ".join(f"{r['change_cpu_s'][k]:.1f}" for k in
                              ("worker", "server", "scheduler")) if "change_cpu_s" in r else "-"),
        ("load (1/5/15 min) steady", lambda r: r["load_steady"]))


def parse_sizes(text: str):
    sizes = []
    for part in text.split(","):
        w, _, sv = part.partition(":")
        sizes.append((int(w), int(sv) if sv else max(1, int(w) // 8)))
    return sizes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="16:2,64:8,256:32",
                   help="workers:servers per job, comma-separated (default %(default)s)")
    p.add_argument("--elastic-at", type=int, default=256,
                   help="run this worker count as an elastic job and kill one worker (0: none)")
    p.add_argument("--loss-timeout", type=float, default=3.0,
                   help="BYTEPS_TIMEOUT of the elastic job: how long a silent worker is waited for")
    p.add_argument("--no-report", dest="report", action="store_false",
                   help="do not report the killed worker to the scheduler (as bpslaunch does): "
                        "it is then found lost after --loss-timeout")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between rounds")
    p.add_argument("--steady", type=float, default=10.0, help="seconds of steady state measured")
    p.add_argument("--settle", type=float, default=3.0, help="seconds after the first sums")
    p.add_argument("--form-timeout", type=float, default=900.0)
    p.add_argument("--no-priority", dest="priority", action="store_false",
                   help="leave the scheduler and servers at the workers' CPU priority")
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--out-dir")
    args = p.parse_args()
    results, failures = [], {}
    with common.stop_on_signals():
        for n, s in parse_sizes(args.sizes):
            print(f"{n} workers + {s} servers (load {load()}) ...", flush=True)
            try:
                results.append(run_size(n, s, args, elastic=(n == args.elastic_at)))
            except common.JobFailed as exc:   # the other sizes still run and are reported
                print(f"  FAILED: {exc}", file=sys.stderr, flush=True)
                failures[f"{n}+{s}"] = str(exc)[:3000]
                continue
            r = results[-1]
            print(f"  form {r['form_s']:.1f} s (after the last init {r['form_after_last_s']:.1f}), "
                  f"first sum {r['first_sum_s']:.1f} s, scheduler "
                  f"{r['scheduler']['cpu_pct_mean']:.1f} % of a core", flush=True)
    if not results:
        return 1
    headers = ["measure"] + [f"{r['workers']} + {r['servers']}" for r in results]
    common.print_table("control plane (numpy path, loopback, every sum checked)", headers,
                       [[name] + [fn(r) for r in results] for name, fn in ROWS])
    common.write_json("control_plane", {"args": vars(args), "results": results,
                                        "failures": failures}, args.out_dir)
    return 1 if failures else 0


if __name__ == "__main__":
    common.run_main(main)
