"""No single point of failure in an elastic job (docs/elastic.md): servers
and the scheduler may be lost, replaced, added or leave while the workers
train. One cluster of numpy workers (no TensorFlow: tests/workers/
elastic_servers_numpy.py) started process by process, the scheduler in a
process of its own; the test loses and restarts its pieces one after the
other and checks that the training goes on, rolls back only where it must,
and ends where an uninterrupted run ends, bit for bit."""
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "workers", "elastic_servers_numpy.py")
SCALE = float(os.environ.get("BPS_TEST_TIMEOUT_SCALE", "2"))
N = 16384
COMMIT = 5


class Cluster:
    """A scheduler, servers and numpy workers of one elastic job, each a
    process the test can kill or restart."""

    def __init__(self, out, workers=2, servers=2):
        self.out = out
        self.procs = {}     # name -> Popen (the latest of that name)
        self.all = []
        self.port = 0
        self.base = dict(os.environ)
        self.base.pop("TF_CONFIG", None)
        self.base.update({
            "DMLC_NUM_WORKER": str(workers), "DMLC_NUM_SERVER": str(servers),
            "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_NODE_HOST": "127.0.0.1",
            "BYTEPS_BIND_HOST": "127.0.0.1", "BYTEPS_SERVER_PORT": "0",
            "BYTEPS_JOB_TOKEN": secrets.token_hex(16), "BYTEPS_ELASTIC": "1",
            "BYTEPS_ELASTIC_MIN_WORKERS": "1", "BYTEPS_ELASTIC_MAX_WORKERS": str(workers),
            "BYTEPS_TIMEOUT": "3", "BYTEPS_PARTITION_BYTES": "4096",
            "BYTEPS_LOG_LEVEL": "INFO",
        })
        self.start_scheduler()
        for i in range(servers):
            self.start_server(i)
        for r in range(workers):
            self.start(f"worker{r}", [sys.executable, WORKER, out],
                       {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(r),
                        "DMLC_PS_ROOT_PORT": str(self.port)})

    def start(self, name, argv, extra):
        log = open(os.path.join(self.out, f"{name}.{len(self.all)}.log"), "w")
        proc = subprocess.Popen(argv, env=dict(self.base, **extra), stdout=log,
                                stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
                                start_new_session=True)
        self.procs[name] = proc
        self.all.append(proc)
        return proc

    def start_scheduler(self):
        ready = os.path.join(self.out, "port")
        self.start("scheduler", [sys.executable, "-m", "bps_tf.server"],
                   {"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_PORT": str(self.port),
                    "BYTEPS_READY_FILE": ready})
        if self.port:
            return
        deadline = time.time() + 30 * SCALE
        while not os.path.exists(ready):
            assert time.time() < deadline, self.logs()
            time.sleep(0.02)
        self.port = int(open(ready).read().strip())

    def start_server(self, i):
        self.start(f"server{i}", [sys.executable, "-m", "bps_tf.server"],
                   {"DMLC_ROLE": "server", "BYTEPS_SERVER_ID": str(i),
                    "DMLC_PS_ROOT_PORT": str(self.port)})

    def logs(self):
        text = ""
        for name in sorted(os.listdir(self.out)):
            if name.endswith(".log"):
                with open(os.path.join(self.out, name)) as f:
                    text += f"--- {name}\n{f.read()[-3000:]}\n"
        return text

    def read(self, name):
        try:
            with open(os.path.join(self.out, name + ".json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def wait_for(self, what, check, timeout=60):
        deadline = time.time() + timeout * SCALE
        while time.time() < deadline:
            found = check()
            if found:
                return found
            for name in ("worker0", "worker1"):
                code = self.procs[name].poll()
                assert code is None or code == 0 or name == "worker1" and code == 0, f"{name} exited {code} waiting for {what}\n" + \
                    self.logs()
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}\n" + self.logs())

    def progress(self):
        return [self.read(f"progress_{r}") for r in (0, 1)]


    def stepped_past(self, step, epoch_above=-1):
        p = self.progress()
        return all(x and x["step"] >= step and x["epoch"] > epoch_above for x in p) and p

    def close(self):
        for p in self.all:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def _reference(trained, until):
    """The weights after steps 0..until-1, each trained last with the size
    `trained` (the worker's (step, size) log, rollbacks included) says."""
    size_of = {}
    for step, size in trained:
        size_of[step] = size
    w = np.zeros(N, np.float32)
    for step in range(until):
        size = size_of[step]
        grads = [(w * np.float32(0.01) + np.float32((r + 1) * (step % 7 + 1))).astype(np.float32)
                 for r in range(size)]
        w = w - np.float32(0.001) * (sum(grads) / np.float32(size))
    return w


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("spof"))
    c = Cluster(out)
    times = {}
    try:
        first = c.wait_for("the first steps", lambda: c.stepped_past(8))
        # 1. A server is lost (SIGKILL): the workers roll back and go on
        #    with the other one.
        epoch = max(p["epoch"] for p in first)
        c.procs["server1"].send_signal(signal.SIGKILL)
        times["server_killed"] = time.time()
        after = c.wait_for("training after the lost server",
                           lambda: c.stepped_past(0, epoch_above=epoch))
        times["server_back"] = min(p["time"] for p in after)
        # 2. A replacement (the same id) joins at the next commit, no rollback.
        #    Worker 1 comes back from that change later than BYTEPS_TIMEOUT=3 s
        #    (a loaded machine): its heartbeats say it is alive, so it is waited for.
        epoch = max(p["epoch"] for p in after)
        with open(os.path.join(out, "slow_1"), "w") as f:
            f.write(str(3 * SCALE + 2))
        c.start_server(1)
        after = c.wait_for("the replacement server", lambda: c.stepped_past(0, epoch_above=epoch))
        # 3. The scheduler's process is lost and started again at its address.
        #    Worker 1 again comes back late: the servers, which reported at
        #    once, hear nothing for longer than BYTEPS_TIMEOUT and report
        #    again; the same process reporting twice is no second claim.
        epoch = max(p["epoch"] for p in after)
        with open(os.path.join(out, "slow_1"), "w") as f:
            f.write(str(3 * SCALE + 2))
        c.procs["scheduler"].send_signal(signal.SIGKILL)
        c.procs["scheduler"].wait(10)
        times["scheduler_killed"] = time.time()
        c.start_scheduler()
        after = c.wait_for("training after the scheduler restarted",
                           lambda: c.stepped_past(0, epoch_above=epoch))
        times["scheduler_back"] = min(p["time"] for p in after)
        # 4. SIGTERM to server 0: it leaves at the next commit (exit 0), its
        #    keys move to server 1, nothing is rolled back.
        epoch = max(p["epoch"] for p in after)
        c.procs["server0"].send_signal(signal.SIGTERM)
        after = c.wait_for("training after server 0 left",
                           lambda: c.stepped_past(0, epoch_above=epoch))
        codes = {"server0_left": c.procs["server0"].wait(30 * SCALE)}
        # 5. SIGTERM to worker 1: it leaves at the next commit (exit 0); worker
        #    0 trains on alone (BYTEPS_ELASTIC_MIN_WORKERS=1).
        epoch = max(p["epoch"] for p in after)
        c.procs["worker1"].send_signal(signal.SIGTERM)
        codes["worker1_left"] = c.procs["worker1"].wait(60 * SCALE)
        after = c.wait_for("worker 0 alone", lambda: (
            lambda p: p and p["size"] == 1 and p["epoch"] > epoch and p)(c.read("progress_0")))
        c.wait_for("a few more steps", lambda: (
            lambda p: p and p["step"] >= after["step"] + 6 and p)(c.read("progress_0")))
        open(os.path.join(out, "finish"), "w").close()
        deadline = time.time() + 60 * SCALE
        for name in ("worker0", "server1", "scheduler"):
            try:
                codes[name] = c.procs[name].wait(max(1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        done = [c.read(f"done_{r}") for r in (0, 1)]
        yield c, times, codes, done
    finally:
        c.close()


def test_the_job_survives_and_every_process_ends_cleanly(scenario):
    c, _, codes, done = scenario
    assert codes == dict.fromkeys(codes, 0), (codes, c.logs())
    assert all(d is not None for d in done), c.logs()
    log = c.logs()
    assert "lost server 1" in log and "the scheduler restarted" in log, log
    assert "server 0 (host" in log and "left the job; its keys move to the other servers" in log
    # the late survivor (step 2) was waited for, not dropped
    assert not os.path.exists(os.path.join(c.out, "slow_1")), "worker 1 never restarted"
    assert "did not come back" not in log and "no longer a member" not in log, log
    assert "is claimed twice" not in log, log


def test_final_weights_equal_an_uninterrupted_run_bit_for_bit(scenario):
    c, _, _, done = scenario
    for r, d in enumerate(done):
        got = np.load(os.path.join(c.out, f"w_{r}.npy"))
        want = _reference(d["trained"], d["step"])
        assert np.array_equal(got, want), (r, float(np.abs(got - want).max()))
    assert [d["size"] for d in done] == [1, 2]      # worker 1 left with 2, worker 0 ended alone


def test_only_the_losses_roll_back(scenario):
    _, _, _, done = scenario
    kinds = [e["kind"] for e in done[0]["events"]]
    # a lost server and a restarted scheduler roll back; the joining server,
    # the leaving server and the leaving worker are taken at a commit
    assert kinds == ["changed", "updates", "changed", "updates", "updates"], done[0]["events"]
    assert [e["kind"] for e in done[1]["events"]] == kinds[:4], done[1]["events"]
    for d in done:
        redone = len(d["trained"]) - d["step"]
        rolled = [e for e in d["events"] if e["kind"] == "changed"]
        for e in rolled:
            assert e["back_to"] % COMMIT == 0 and 0 <= e["step"] - e["back_to"] <= COMMIT
        # the steps redone are exactly those the rollbacks undid: none for the
        # joins and leaves
        assert redone == sum(e["step"] - e["back_to"] for e in rolled), d["events"]


def test_recovery_times(scenario):
    _, times, _, _ = scenario
    # a SIGKILLed server: its workers' links break, or BYTEPS_TIMEOUT=3 s
    assert times["server_back"] - times["server_killed"] < 3 + 10 * SCALE
    assert times["scheduler_back"] - times["scheduler_killed"] < 3 * SCALE + 2 + 15 * SCALE
    print("recovery:", {k: round(times[k.replace("killed", "back")] - v, 2)
                        for k, v in times.items() if k.endswith("killed")})


def test_the_scheduler_and_a_server_lost_together(tmp_path):
    """The scheduler's process and a server die at once (on Kubernetes the
    scheduler runs inside server 0's pod): the workers' sums fail, they
    restart their membership and say HELLO as returning members to the new
    scheduler, which must take them as its reports, not as newcomers."""
    out = str(tmp_path)
    c = Cluster(out)
    try:
        first = c.wait_for("the first steps", lambda: c.stepped_past(8))
        epoch = max(p["epoch"] for p in first)
        for name in ("scheduler", "server1"):
            c.procs[name].send_signal(signal.SIGKILL)
        for name in ("scheduler", "server1"):
            c.procs[name].wait(10)
        c.start_scheduler()
        c.start_server(1)
        after = c.wait_for("training after the scheduler and server 1 came back",
                           lambda: c.stepped_past(0, epoch_above=epoch))
        assert all(p["size"] == 2 for p in after), after
        open(os.path.join(out, "finish"), "w").close()
        codes = {name: c.procs[name].wait(60 * SCALE)
                 for name in ("worker0", "worker1", "server0", "server1", "scheduler")}
        done = [c.read(f"done_{r}") for r in (0, 1)]
    finally:
        c.close()
    log = c.logs()
    assert codes == dict.fromkeys(codes, 0), (codes, log)
    assert "no longer a member" not in log and "is left" not in log, log
    for r, d in enumerate(done):   # every step trained right, rollbacks included
        assert d is not None, log
        got = np.load(os.path.join(out, f"w_{r}.npy"))
        assert np.array_equal(got, _reference(d["trained"], d["step"])), r
