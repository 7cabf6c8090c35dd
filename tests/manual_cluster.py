"""Starts a bps_tf cluster process by process (no launcher supervision), so
tests can kill, probe and attack individual processes."""
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ManualCluster:
    def __init__(self, num_workers, num_servers, worker_args, env=None, token=None,
                 server_env=None, before_workers=None):
        """`server_env` is added to the servers' environment only;
        `before_workers(port)`, if given, runs once the servers are up and
        returns what to add to the workers' environment."""
        self.dir = tempfile.mkdtemp(prefix="bps_manual_")
        self.base = dict(os.environ)
        self.base.pop("TF_CONFIG", None)
        self.base.update({
            "DMLC_NUM_WORKER": str(num_workers), "DMLC_NUM_SERVER": str(num_servers),
            "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_NODE_HOST": "127.0.0.1",
            "BYTEPS_BIND_HOST": "127.0.0.1", "BYTEPS_SERVER_PORT": "0",
            "BYTEPS_JOB_TOKEN": token if token is not None else secrets.token_hex(16),
        })
        self.base.update(env or {})
        self.servers, self.workers = [], []
        self.port = None
        ready = os.path.join(self.dir, "port")
        self.servers.append(self._start(
            "server0", [sys.executable, "-m", "bps_tf.server"],
            dict(server_env or {}, DMLC_ROLE="server", BYTEPS_SERVER_ID="0",
                 BYTEPS_HOST_SCHEDULER="1", DMLC_PS_ROOT_PORT="0", BYTEPS_READY_FILE=ready)))
        deadline = time.time() + 30
        while self.port is None:
            if os.path.exists(ready):
                self.port = int(open(ready).read().strip())
            elif time.time() > deadline or self.servers[0].poll() is not None:
                log = self.log("server0")
                self.close()
                raise RuntimeError("server 0 did not start: " + log)
            else:
                time.sleep(0.02)
        for i in range(1, num_servers):
            self.servers.append(self._start(
                f"server{i}", [sys.executable, "-m", "bps_tf.server"],
                dict(server_env or {}, DMLC_ROLE="server", BYTEPS_SERVER_ID=str(i),
                     DMLC_PS_ROOT_PORT=str(self.port))))
        worker_env = before_workers(self.port) if before_workers else {}
        for r in range(num_workers):
            self.workers.append(self._start(
                f"worker{r}", [sys.executable] + list(worker_args),
                dict(worker_env, DMLC_ROLE="worker", DMLC_WORKER_ID=str(r),
                     DMLC_PS_ROOT_PORT=str(self.port or 0))))

    def _start(self, name, argv, extra):
        env = dict(self.base, **extra)
        log = open(os.path.join(self.dir, name + ".log"), "w")
        # A neutral working directory: the source tree must not shadow the
        # installed package for `python -m`.
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                cwd=tempfile.gettempdir(), start_new_session=True)

    def log(self, name):
        with open(os.path.join(self.dir, name + ".log")) as f:
            return f.read()

    def wait_all(self, procs, timeout):
        deadline = time.time() + timeout
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop(self):
        for p in self.servers + self.workers:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def close(self):
        """Stops every process and removes the logs' folder (read them before)."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0
