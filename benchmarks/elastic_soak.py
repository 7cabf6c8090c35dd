"""Soak: elastic `model.fit` while a chaos loop kills or terminates one
random process of the job at a time (issue 45's soak acceptance).

    sudo python benchmarks/elastic_soak.py [--minutes 10] [--seed 0] [--out PATH]

The job: `bpslaunch -np 2 --servers 2 --min-np 1 --max-np 2
--host-discovery-script "cat HOSTS" --discovery-interval 0.5`, its workers
running benchmarks/workers/elastic_soak_fit.py (a small MLP on a synthetic
classification task under `BytePSStrategy(elastic=True)`, a fixed global
batch, ~250 steps an epoch). Hosts have one slot each (`HOST:1` lines,
hosts as horovodrun has them). bpslaunch runs the scheduler in its own
process and replaces a lost server or scheduler itself
(bps_tf/launch/keeper.py).

Where it runs (`--place`): as root with `ip netns`, on network-namespace
hosts (benchmarks/netns_hosts.py: each its own address, loopback, ports
and abstract Unix sockets, on one bridge). bpslaunch, the scheduler and the
servers run on the first host (`--address`); each worker runs on a host of
its own, started there by bpslaunch through `--host-exec` (a script that
runs `exec ip netns exec NS "$@"` for the host), so every sum crosses the
bridge over TCP. Without root: on the machine's loopback, hosts 127.0.0.N.

The chaos loop: every 30-60 s (and never before the job recovered from the
previous event) it picks one process at random -- a worker that trains in
the current membership, a server, or the scheduler -- and sends it SIGKILL
or SIGTERM at random. Recovered means: training resumed in a membership
formed after the kill, the job has all its workers again, and a replaced
server has joined (the scheduler's "joins at membership epoch" line). A
SIGKILLed worker's host is blacklisted by bpslaunch (horovodrun's policy);
the loop then rewrites the discovery file with a fresh host in its place,
and bpslaunch starts a replacement there. A worker that leaves on SIGTERM
keeps its host: bpslaunch starts its replacement on the slot it frees.

After --minutes of chaos the soak tells the workers the last epoch (two
ahead); then the same training runs uninterrupted in one process on the
global batch (what every elastic epoch equals, docs/elastic.md) for the
same number of epochs: the baseline. Checked and reported: bpslaunch's exit
code is 0; every worker's History holds every epoch exactly once; the
held-out and last-epoch accuracies equal the baseline's within 0.01; no
process of the job is left (psutil: the job's token in its environment,
or once a descendant of bpslaunch); every event, with the seconds until
training resumed and until the job was whole again, and the steps redone.
Prints tables and writes benchmarks/results/elastic_soak.json (--out).
Exit code 0 when every check passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.common import PYTHON, WORKERS_DIR, JobFailed  # noqa: E402
from benchmarks.netns_hosts import NetnsHosts, NetnsUnavailable  # noqa: E402
from benchmarks.soak_watch import (Descendants, Event, Progress, Tail,  # noqa: E402
                                   job_processes, leftovers, process_env)

SCRIPT = str(WORKERS_DIR / "elastic_soak_fit.py")
# Two runs of this training that differ only in float rounding (initial
# weights scaled by 1 + 1e-6 noise) stayed within 0.004 of each other's
# held-out accuracy and 0.0012 of the training accuracy through 96 epochs
# (every 12th measured): a soak 0.01 off the baseline shows more than rounding.
SPEC = {"rows": 12000, "held_out": 4000, "features": 16, "classes": 4, "label_noise": 0.0,
        "hidden": [64, 64], "batch": 48, "lr": 0.001, "max_epochs": 100000}
TOLERANCE = 0.01               # accuracy, against the baseline
INTERVAL_S = (30.0, 60.0)      # between two events
CALM_S = 5.0                   # training at full strength before the next event, at least
START_TIMEOUT_S = 300.0        # from the launch to the first step
RECOVERY_TIMEOUT_S = 300.0     # from an event to the job whole again
POLL_S = 0.2


@dataclass
class Place:
    name: str          # netns-hosts / loopback
    prefix: tuple      # the command prefix that puts bpslaunch there
    text: str
    pool: list         # the worker hosts' addresses, in the order they are offered
    options: list      # bpslaunch's options that start the workers on them (--host-exec)


def enter_script(path: Path, hosts) -> str:
    """bpslaunch's --host-exec for namespace hosts: `sh PATH {host}` runs the
    worker in that host's namespace, in place (`exec ip netns exec`)."""
    cases = "".join(f"  {h.ip}) exec ip netns exec {h.name} \"$@\" ;;\n" for h in hosts)
    path.write_text("#!/bin/sh\n# bpslaunch --host-exec: run the command on host $1, in place\n"
                    f"host=$1; shift\ncase \"$host\" in\n{cases}esac\n"
                    "echo \"no namespace host $host\" >&2; exit 127\n")
    return f"sh {path} {{host}}"


@contextlib.contextmanager
def place(choice: str, pool_size: int, work_dir: Path):
    why = "--place loopback"
    loopback = [f"127.0.0.{i}" for i in range(2, min(pool_size + 2, 255))]
    with contextlib.ExitStack() as stack:
        if choice != "loopback":
            try:
                net = stack.enter_context(NetnsHosts(1 + pool_size))
            except NetnsUnavailable as exc:
                if choice == "netns-hosts":
                    raise JobFailed(f"--place netns-hosts: {exc}") from None
                why = f"no namespace: {exc}"
            else:
                home, workers = net.hosts[0], net.hosts[1:]
                yield Place("netns-hosts", home.prefix,
                            f"network-namespace hosts on a bridge: bpslaunch, the scheduler "
                            f"and the servers on {home.ip}, each worker on a host of its own "
                            f"({workers[0].ip} ... {workers[-1].ip}, started there by "
                            f"--host-exec)",
                            [h.ip for h in workers],
                            ["--host-exec", enter_script(work_dir / "enter_host.sh", workers),
                             "--address", home.ip])
                return
        yield Place("loopback", (), f"the machine's loopback, hosts 127.0.0.N ({why})",
                    loopback, [])


class Hosts:
    """The discovery script's file: one `HOST:1` line per host, taken in
    turn from the pool (a SIGKILLed worker's host is blacklisted for good)."""

    def __init__(self, path: Path, count: int, pool: list):
        self.path = path
        self.pool = list(pool)
        self.next = 0
        self.hosts = [self._fresh() for _ in range(count)]
        self._write()

    def _fresh(self) -> str:
        if self.next >= len(self.pool):
            raise JobFailed(f"out of fresh hosts ({len(self.pool)} in the pool)")
        self.next += 1
        return self.pool[self.next - 1]

    def replace(self, host: str) -> str:
        fresh = self._fresh()
        self.hosts = [h for h in self.hosts if h != host] + [fresh]
        self._write()
        return fresh

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(f"{h}:1\n" for h in self.hosts))
        tmp.replace(self.path)


def kill_one(rng: random.Random, n: int, progress: Progress, token: str, workers: int,
             servers: int, kinds):
    """Sends SIGKILL or SIGTERM to one random process of the job; None when
    no candidate is alive right now (tried again at the next poll)."""
    alive = job_processes(token)
    by_label = {}
    for pid, launch_id in alive.items():
        by_label.setdefault(launch_id, []).append(pid)
    labels = [w for w in progress.members() if len(by_label.get(w, [])) == 1] \
        if "worker" in kinds else []
    labels += [f"server {i}" for i in range(servers) if "server" in kinds and
               len(by_label.get(f"server {i}", [])) == 1]
    labels += ["scheduler"] if "scheduler" in kinds and len(by_label.get("scheduler", [])) == 1 \
        else []
    if not labels:
        return None
    victim = rng.choice(labels)
    signum = rng.choice([signal.SIGKILL, signal.SIGTERM])
    pid = by_label[victim][0]
    kind = "scheduler" if victim == "scheduler" else "server" if victim.startswith("server") \
        else "worker"
    host = process_env(pid).get("HOROVOD_HOSTNAME", "") if kind == "worker" else ""
    m_before = progress.membership()
    t_kill = time.time()
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return None
    event = Event(n, victim, kind, pid, signal.Signals(signum).name, t_kill, m_before, workers,
                  host)
    print(f"  [{time.strftime('%H:%M:%S')}] event {n}: {signal.Signals(signum).name} to "
          f"{event.label} (pid {pid}), membership epoch {m_before}", flush=True)
    return event


def soak(args, procs: common.Processes, where: Place, rng: random.Random) -> dict:
    out = procs.log_dir / "soak"
    out.mkdir()
    (out / "spec.json").write_text(json.dumps(dict(SPEC, seed=args.seed)))
    hosts = Hosts(out / "hosts", args.workers, where.pool)
    token = secrets.token_hex(16)
    limit = args.minutes * 60 + 900
    command = [PYTHON, "-m", "bps_tf.launch", "-np", str(args.workers), "--servers",
               str(args.servers), "--min-np", "1", "--max-np", str(args.workers),
               "--host-discovery-script", f"cat {hosts.path}", "--discovery-interval", "0.5",
               "--timeout", str(limit), *where.options, PYTHON, SCRIPT, str(out), "soak"]
    launcher = procs.start("bpslaunch", command, common.child_env({"BYTEPS_JOB_TOKEN": token}),
                           where.prefix, must_succeed=False)
    progress, log, family = Progress(out), Tail(launcher.log), Descendants(launcher.popen.pid)
    began = time.time()
    events, active, rewrite = [], None, None
    train_start = next_kill = chaos_until = stop_at = None
    last_epoch = None
    while launcher.popen.poll() is None:
        if time.time() - began > limit + 120:
            raise JobFailed(f"bpslaunch still runs after {limit + 120} s:\n{launcher.tail()}")
        family.sample()
        fresh, lines = progress.poll(), log.lines()
        now = time.time()
        if train_start is None:
            batches = [r["t"] for r in fresh if r["k"] == "b"]
            if not batches:
                if now - began > START_TIMEOUT_S:
                    raise JobFailed(f"no training step within {START_TIMEOUT_S:g} s:\n"
                                    f"{launcher.tail()}")
                time.sleep(POLL_S)
                continue
            train_start = batches[0]
            chaos_until = train_start + args.minutes * 60
            next_kill = train_start + rng.uniform(*INTERVAL_S)
            print(f"  training started {train_start - began:.1f} s after the launch", flush=True)
        if active is not None:
            active.see(fresh, lines)
            if rewrite and (any(f"host {rewrite} is blacklisted" in ln for ln in lines)
                            or now - active.t_kill > 30):
                fresh_host = hosts.replace(rewrite)
                print(f"    host {rewrite} blacklisted; the discovery file offers {fresh_host}",
                      flush=True)
                rewrite = None
            if active.whole_at is not None:
                print(f"    resumed after {active.resumed_at - active.t_kill:.1f} s, whole after "
                      f"{active.whole_at - active.t_kill:.1f} s", flush=True)
                next_kill = max(next_kill, active.whole_at + CALM_S)
                active = None
            elif now - active.t_kill > RECOVERY_TIMEOUT_S:
                active.failed = f"not whole again within {RECOVERY_TIMEOUT_S:g} s"
                print(f"    {active.failed}; no more events", flush=True)
                chaos_until, active = now, None
        if active is None and stop_at is None:
            if now >= chaos_until:
                last_epoch = progress.epoch() + 2
                (out / "stop.tmp").write_text(json.dumps({"last_epoch": last_epoch}))
                (out / "stop.tmp").replace(out / "stop.json")
                stop_at = now
                print(f"  chaos over after {now - train_start:.0f} s; the workers stop after "
                      f"epoch {last_epoch}", flush=True)
            elif now >= next_kill:
                active = kill_one(rng, len(events) + 1, progress, token, args.workers,
                                  args.servers, args.victims)
                if active is not None:
                    events.append(active)
                    next_kill = active.t_kill + rng.uniform(*INTERVAL_S)
                    rewrite = active.host if (active.kind == "worker"
                                              and active.signal == "SIGKILL") else None
        time.sleep(POLL_S)
    ended = time.time()
    code = launcher.popen.returncode
    progress.poll()
    left = leftovers(token, family)
    t0 = train_start or began
    done = {p.stem[len("done_"):]: json.loads(p.read_text()) for p in out.glob("done_*.json")}
    return {"command": " ".join(list(where.prefix) + command),
            "exit_code": code, "seconds": round(ended - began, 1),
            "chaos_seconds": round((stop_at or ended) - t0, 1), "last_epoch": last_epoch,
            "events": [e.row(t0, progress) for e in events], "done": done, "leftovers": left,
            "hosts_offered_last": hosts.hosts, "launcher_tail": launcher.tail(40)}


def baseline(procs: common.Processes, seed: int, epochs: int) -> dict:
    out = procs.log_dir / "baseline"
    out.mkdir()
    (out / "spec.json").write_text(json.dumps(dict(SPEC, seed=seed, epochs=epochs)))
    child = procs.start("baseline", [PYTHON, SCRIPT, str(out), "baseline"], common.child_env())
    procs.wait([child], timeout=1800)
    return json.loads((out / "baseline.json").read_text())


def check(result: dict, base: dict) -> list:
    """(check, what was found, passed) rows."""
    rows = [("bpslaunch exit code 0", f"exit code {result['exit_code']}",
             result["exit_code"] == 0)]
    done = result["done"]
    want = list(range(result["last_epoch"] + 1)) if result["last_epoch"] is not None else None
    bad = {w: d["history"]["epoch"] for w, d in done.items() if d["history"]["epoch"] != want}
    rows.append(("History: every epoch exactly once",
                 f"{len(done)} worker(s) finished, epochs 0..{result['last_epoch']}" if not bad
                 else f"mismatch: {bad}", bool(done) and not bad and want is not None))
    if done and base:
        acc = [d["accuracy"] for d in done.values()]
        last = [d["history"]["logs"]["accuracy"][-1] for d in done.values()]
        b_acc, b_last = base["accuracy"], base["history"]["logs"]["accuracy"][-1]
        worst = max(abs(a - b_acc) for a in acc)
        worst_last = max(abs(a - b_last) for a in last)
        rows.append(("held-out accuracy = baseline's +- 0.01",
                     f"{acc[0]:.4f} vs {b_acc:.4f} (|diff| {worst:.4f})", worst <= TOLERANCE))
        rows.append(("last epoch's accuracy (History) = baseline's +- 0.01",
                     f"{last[0]:.4f} vs {b_last:.4f} (|diff| {worst_last:.4f})",
                     worst_last <= TOLERANCE))
        digests = sorted({d["digest"] for d in done.values()})
        rows.append(("same weights on every worker", ", ".join(digests), len(digests) == 1))
    else:
        rows.append(("accuracy = baseline's +- 0.01", "no result to compare", False))
    left = result["leftovers"]
    rows.append(("no process left behind", "none" if not left else
                 "; ".join(f"{d['pid']} {d['command']}" for d in left), not left))
    events = result["events"]
    failed = [e for e in events if e["whole_after_s"] is None]
    rows.append(("every event recovered", f"{len(events) - len(failed)} of {len(events)}",
                 bool(events) and not failed))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="of chaos (default 10)")
    ap.add_argument("--seed", type=int, default=0, help="data, model and chaos (default 0)")
    ap.add_argument("--out", default=str(common.RESULTS_DIR / "elastic_soak.json"),
                    help="the JSON result (default benchmarks/results/elastic_soak.json)")
    ap.add_argument("--place", choices=("auto", "netns-hosts", "loopback"), default="auto",
                    help="auto: network-namespace hosts when root, else loopback hosts")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--victims", default="worker,server,scheduler",
                    help="the kinds of process the chaos loop picks from (default all three)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the logs (kept on failure)")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.workers < 2 or args.servers < 1:
        ap.error("need --minutes > 0, --workers >= 2 and --servers >= 1")
    args.victims = [k.strip() for k in args.victims.split(",") if k.strip()]
    if not args.victims or set(args.victims) - {"worker", "server", "scheduler"}:
        ap.error("--victims: a comma-separated list of worker, server, scheduler")
    rng = random.Random(args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="bps_soak_"))
    procs = common.Processes(log_dir)
    passed = False
    try:
        # Hosts for the workers: the first ones, and one fresh host for each
        # event that may blacklist one (at most one event every 30 s).
        pool_size = args.workers + int(args.minutes * 60 / INTERVAL_S[0]) + 2
        with common.stop_on_signals(), place(args.place, pool_size, log_dir) as where:
            print(f"elastic soak: {args.minutes:g} min of chaos; {args.workers} workers, "
                  f"{args.servers} servers; {where.text}; logs in {log_dir}", flush=True)
            result = soak(args, procs, where, rng)
        procs.stop()
        epochs = (result["last_epoch"] + 1) if result["last_epoch"] is not None else 0
        base = {}
        if result["done"] and epochs:
            print(f"baseline: {epochs} epochs in one process ...", flush=True)
            base = baseline(procs, args.seed, epochs)
        rows = check(result, base)
        passed = all(ok for _, _, ok in rows)
        report(args, where, result, base, rows, passed)
        return 0 if passed else 1
    finally:
        procs.stop()
        if passed and not args.keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            print(f"logs kept in {log_dir}", flush=True)


def report(args, where: Place, result: dict, base: dict, rows: list, passed: bool) -> None:
    events = result["events"]
    common.print_table(
        f"events ({where.name}; chaos {result['chaos_seconds']:.0f} s, "
        f"{result['last_epoch'] + 1 if result['last_epoch'] is not None else '?'} epochs)",
        ["#", "time", "at s", "process", "signal", "resumed after s", "whole after s",
         "steps redone", "workers after"],
        [[e["n"], e["clock"], e["at_s"], e["process"], e["signal"],
          "-" if e["resumed_after_s"] is None else e["resumed_after_s"],
          "never" if e["whole_after_s"] is None else e["whole_after_s"], e["steps_redone"],
          e["workers_after"] if e["workers_after"] is not None else "-"] for e in events])
    common.print_table("checks", ["check", "found", "pass"],
                       [[c, found, "yes" if ok else "NO"] for c, found, ok in rows])
    soak_s = result["seconds"]
    if not passed:
        print(f"\nbpslaunch's last lines:\n{result['launcher_tail']}", flush=True)
    print(f"\nsoak {soak_s:.0f} s under bpslaunch; baseline "
          f"{base.get('seconds', float('nan')):.0f} s of fit in one process; "
          f"{'PASSED' if passed else 'FAILED'}", flush=True)
    out = Path(args.out)
    payload = {"args": vars(args), "place": where.text, "spec": dict(SPEC, seed=args.seed),
               "passed": passed,
               "checks": [{"check": c, "found": f, "pass": ok} for c, f, ok in rows],
               "soak": {k: v for k, v in result.items()
                        if k != "launcher_tail" or not passed},
               "baseline": base}
    common.write_json(out.stem, payload, str(out.parent))


if __name__ == "__main__":
    common.run_main(main)
