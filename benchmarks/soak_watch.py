"""What benchmarks/elastic_soak.py watches while its job trains: the workers'
progress lines, bpslaunch's output, the job's processes, and each chaos
event until the job has recovered from it. No TensorFlow here.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import psutil

# The scheduler's line when a server (a replacement) joins: its id, pid and epoch.
SERVER_JOINS = re.compile(r"server (\d+)(?: \(host [^,()]*, pid (\d+)\))? joins at membership "
                          r"epoch (\d+)")


class Tail:
    """New whole lines of a growing file, as they come."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0

    def lines(self) -> List[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        return chunk[:end].decode("utf-8", errors="replace").splitlines()


class Progress:
    """The workers' progress files (benchmarks/workers/elastic_soak_fit.py):
    every record by worker (bpslaunch's label), in the order written."""

    def __init__(self, out: Path):
        self.out = out
        self.tails: Dict[str, Tail] = {}
        self.records: Dict[str, List[dict]] = {}

    def poll(self) -> List[dict]:
        fresh = []
        for path in sorted(self.out.glob("progress_*.jsonl")):
            worker = path.stem[len("progress_"):]
            tail = self.tails.setdefault(worker, Tail(path))
            for line in tail.lines():
                rec = dict(json.loads(line), w=worker)
                self.records.setdefault(worker, []).append(rec)
                fresh.append(rec)
        fresh.sort(key=lambda r: r["t"])
        return fresh

    def last(self) -> List[dict]:
        return [recs[-1] for recs in self.records.values() if recs]

    def membership(self) -> int:
        return max((r["m"] for r in self.last()), default=-1)

    def epoch(self) -> int:
        return max((r["e"] for r in self.last()), default=0)

    def members(self, within_s: float = 10.0) -> List[str]:
        """Workers that trained in the newest membership in the last seconds."""
        m, now = self.membership(), time.time()
        return sorted(r["w"] for r in self.last() if r["m"] == m and now - r["t"] < within_s)

    def attempts(self, worker: str) -> List[dict]:
        """One entry per attempt of an epoch: its start, batches, whether it ended."""
        out: List[dict] = []
        for r in self.records.get(worker, []):
            if r["k"] == "begin" or not out or out[-1]["ended"]:
                out.append({"e": r["e"], "m": r["m"], "t0": r["t"], "t1": r["t"],
                            "batches": 0, "ended": False})
            a = out[-1]
            a["t1"] = r["t"]
            a["batches"] += r["k"] == "b"
            a["ended"] = a["ended"] or r["k"] == "end"
        return out


@dataclass
class Event:
    """One process killed or terminated, and how the job came back."""
    n: int
    victim: str            # bpslaunch's label: "scheduler", "server 1", or a worker's "3"
    kind: str              # worker / server / scheduler
    pid: int
    signal: str
    t_kill: float
    m_before: int          # the newest membership epoch at the kill
    target: int            # workers the job has when whole
    host: str = ""         # a worker's host (HOROVOD_HOSTNAME)
    join_epoch: Optional[int] = None   # a replacement server's, from the scheduler
    resumed_at: Optional[float] = None
    whole_at: Optional[float] = None
    workers_after: Optional[int] = None
    failed: str = ""
    seen: List[dict] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.victim if self.kind != "worker" else f"worker {self.victim}"

    def see(self, records: List[dict], log_lines: List[str]) -> None:
        """Takes new progress records and bpslaunch lines. Training resumed:
        the first batch of a membership formed after the kill. Whole again:
        a batch of such a membership with every worker (and, for a server,
        in or after the epoch its replacement joined at)."""
        for line in log_lines:
            m = SERVER_JOINS.search(line)
            if (self.kind == "server" and m and self.join_epoch is None
                    and f"server {m.group(1)}" == self.victim
                    and (m.group(2) is None or int(m.group(2)) != self.pid)):
                self.join_epoch = int(m.group(3))
        self.seen += [r for r in records if r["k"] == "b" and r["t"] > self.t_kill
                      and r["m"] > self.m_before]
        for r in self.seen:
            self.resumed_at = self.resumed_at or r["t"]
            if self.whole_at is None and r["n"] == self.target and \
                    (self.kind != "server" or
                     (self.join_epoch is not None and r["m"] >= self.join_epoch)):
                self.whole_at, self.workers_after = r["t"], r["n"]
        if self.whole_at is not None:
            self.seen = []

    def steps_redone(self, progress: Progress) -> int:
        """Batches trained in attempts that were rolled back around this
        event (the most on any worker but the victim): 0 for a leave."""
        end = self.whole_at or time.time()
        worst = 0
        for worker in progress.records:
            if self.kind == "worker" and worker == self.victim:
                continue
            attempts = progress.attempts(worker)
            # an attempt cut short (no "end") and begun again after the kill
            lost = sum(a["batches"] for a, nxt in zip(attempts, attempts[1:])
                       if not a["ended"] and nxt["t0"] > self.t_kill and a["t0"] <= end)
            worst = max(worst, lost)
        return worst

    def row(self, t0: float, progress: Progress) -> dict:
        def after(t):
            return None if t is None else round(t - self.t_kill, 2)
        return {"n": self.n, "clock": time.strftime("%H:%M:%S", time.localtime(self.t_kill)),
                "at_s": round(self.t_kill - t0, 1), "process": self.label,
                "pid": self.pid, "signal": self.signal, "resumed_after_s": after(self.resumed_at),
                "whole_after_s": after(self.whole_at), "steps_redone": self.steps_redone(progress),
                "workers_after": self.workers_after, "membership_before": self.m_before,
                "server_join_epoch": self.join_epoch, "failed": self.failed}


# ------------------------------------------------------------------ processes
def job_processes(token: str) -> Dict[int, str]:
    """pid -> BYTEPS_LAUNCH_ID of every live process of the job (its token)."""
    found = {}
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if env.get("BYTEPS_JOB_TOKEN") == token and p.status() != psutil.STATUS_ZOMBIE:
                found[p.pid] = env.get("BYTEPS_LAUNCH_ID", "?")
        except (psutil.Error, OSError):
            continue
    return found


def process_env(pid: int) -> Dict[str, str]:
    try:
        return psutil.Process(pid).environ()
    except (psutil.Error, OSError):
        return {}


class Descendants:
    """Every process seen below bpslaunch, sampled while it runs."""

    def __init__(self, root: int):
        self.root = root
        self.seen: Dict[int, tuple] = {}     # pid -> (create time, command)
        self.last = 0.0

    def sample(self, every_s: float = 1.0) -> None:
        if time.monotonic() - self.last < every_s:
            return
        self.last = time.monotonic()
        try:
            children = psutil.Process(self.root).children(recursive=True)
        except psutil.Error:
            return
        for c in children:
            try:
                self.seen.setdefault(c.pid, (c.create_time(), " ".join(c.cmdline())[:120]))
            except psutil.Error:
                continue

    def alive(self) -> List[dict]:
        left = []
        for pid, (created, cmd) in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    left.append({"pid": pid, "command": cmd})
            except psutil.Error:
                continue
        return left


def leftovers(token: str, descendants: Descendants) -> List[dict]:
    """Processes of the job still alive: with its token, or once below bpslaunch."""
    left = {d["pid"]: d for d in descendants.alive()}
    for pid, launch_id in job_processes(token).items():
        left.setdefault(pid, {"pid": pid, "command": f"BYTEPS_LAUNCH_ID={launch_id}"})
    return sorted(left.values(), key=lambda d: d["pid"])
