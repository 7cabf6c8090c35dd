"""Limits a job meets as its worker count grows (docs/scaling.md).

Every worker connects to every server and to the scheduler at about the same
moment. A listening socket's queue of connections not yet accepted was
libzmq's default of 100: past it a TCP connection waited for the kernel's SYN
retry, and a Unix-socket link (never retried) was lost, so 128 workers on one
machine hung at their first push_pull. These checks stop the server's process
(nothing accepts), connect more peers than the old queue held, and count who
got in; and they hold a server's open-file limit below what its workers need.
"""
import errno
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time

# Above libzmq's old default backlog (100), within a 1024 open-file limit
# for the two kinds of sockets this process opens one after the other.
PEERS = 240
# The job size the server expects: it needs a descriptor per worker twice
# (its own link and the scheduler's it hosts), within a hard limit of 1024.
WORKERS = 300


def _server_env(workers, ready):
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env.update({"DMLC_NUM_WORKER": str(workers), "DMLC_NUM_SERVER": "1", "DMLC_ROLE": "server",
                "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_NODE_HOST": "127.0.0.1",
                "DMLC_PS_ROOT_PORT": "0", "BYTEPS_BIND_HOST": "127.0.0.1",
                "BYTEPS_SERVER_PORT": "0", "BYTEPS_SERVER_ID": "0", "BYTEPS_HOST_SCHEDULER": "1",
                "BYTEPS_READY_FILE": ready, "BYTEPS_JOB_TOKEN": "f" * 32,
                "BYTEPS_RENDEZVOUS_TIMEOUT": "20"})
    return env


def _start_server(workers, tmp, limit=None):
    ready = os.path.join(tmp, "port")
    log = open(os.path.join(tmp, "server.log"), "w")

    def cap():
        if limit:
            resource.setrlimit(resource.RLIMIT_NOFILE, limit)
    proc = subprocess.Popen([sys.executable, "-m", "bps_tf.server"], env=_server_env(workers, ready),
                            stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
                            start_new_session=True, preexec_fn=cap)
    return proc, ready


def _read_log(tmp):
    with open(os.path.join(tmp, "server.log")) as f:
        return f.read()


def _unix_name(pid):
    """The server's abstract Unix socket, once it listens (else None)."""
    with open("/proc/net/unix") as f:
        for line in f:
            name = line.split()[-1]
            if name.startswith(f"@bps_tf-server-{pid}-"):
                return name
    return None


def _wait(predicate, proc, tmp, timeout=60.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert proc.poll() is None, "the server exited: " + _read_log(tmp)
        assert time.monotonic() < deadline, "the server did not listen in time: " + _read_log(tmp)
        time.sleep(0.02)


def _kill(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _connect_all(family, address, count):
    """Non-blocking connects to a listener that accepts nothing: how many the
    kernel queued (a Unix socket refuses the rest with EAGAIN, TCP drops their
    SYN until a retry a second later)."""
    socks, queued = [], 0
    try:
        for _ in range(count):
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            s.setblocking(False)
            code = s.connect_ex(address)
            if code == 0:
                queued += 1
            else:
                assert code in (errno.EAGAIN, errno.EINPROGRESS), os.strerror(code)
        if family == socket.AF_INET:
            import select
            pending = [s for s in socks]
            deadline = time.monotonic() + 0.6   # below the SYN retry (1 s)
            queued = 0
            while pending and time.monotonic() < deadline:
                _, writable, _ = select.select([], pending, [], 0.05)
                for s in writable:
                    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                        queued += 1
                    pending.remove(s)
        return queued
    finally:
        for s in socks:
            s.close()


def _somaxconn():
    with open("/proc/sys/net/core/somaxconn") as f:
        return int(f.read())


def test_a_server_queues_every_peer_that_connects_at_once(tmp_path):
    tmp = str(tmp_path)
    cap = _somaxconn()   # the kernel's bound on any listening queue
    proc, ready = _start_server(WORKERS, tmp)
    try:
        port = int(_wait(lambda: os.path.exists(ready) and open(ready).read().strip(), proc, tmp))
        if cap >= WORKERS:
            name = _wait(lambda: _unix_name(proc.pid), proc, tmp)
        else:   # its workers could not all queue there: it offers TCP alone
            _wait(lambda: "reach this server over TCP" in _read_log(tmp), proc, tmp)
            assert _unix_name(proc.pid) is None
        os.kill(proc.pid, signal.SIGSTOP)   # nothing is accepted from now on
        unix = _connect_all(socket.AF_UNIX, "\0" + name[1:], PEERS) if cap >= WORKERS else None
        tcp = _connect_all(socket.AF_INET, ("127.0.0.1", port), PEERS)
        assert unix in (PEERS, None) and tcp == min(PEERS, cap + 1), (
            f"of {PEERS} peers connecting at once, {unix} reached the Unix socket and {tcp} "
            f"the TCP port: the listening queue is too short (net.core.somaxconn: {cap})")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        _kill(proc)


def test_a_server_raises_its_open_file_limit_for_its_workers(tmp_path):
    tmp = str(tmp_path)
    # Needs 256 + 300 + 301 descriptors: 300 is too few, 1000 (the hard
    # limit, which a process may lower for its child) enough.
    proc, ready = _start_server(WORKERS, tmp, limit=(300, 1000))
    try:
        _wait(lambda: os.path.exists(ready), proc, tmp)
        with open(f"/proc/{proc.pid}/limits") as f:
            line = next(x for x in f if x.startswith("Max open files"))
        assert line.split()[3:5] == ["1000", "1000"], line
    finally:
        _kill(proc)


def test_a_server_whose_hard_file_limit_is_too_low_refuses_to_start(tmp_path):
    tmp = str(tmp_path)
    proc, _ = _start_server(1000, tmp, limit=(400, 400))
    try:
        code = proc.wait(60)
    finally:
        _kill(proc)
    text = _read_log(tmp)
    assert code != 0, text
    # The number it needs, the limit it has, and the way out.
    assert "1000 workers needs about" in text and "at most 400" in text, text
    assert "ulimit -Hn" in text, text


def test_bpslaunch_refuses_a_job_its_open_file_limit_cannot_hold():
    probe = ("import resource, sys\n"
             "resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))\n"
             "from bps_tf.launch import launcher\n"
             "sys.exit(launcher.main(['-np', '300', '--servers', '2', 'true']))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, cwd=tempfile.gettempdir(), env=dict(os.environ))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "needs about 668 open files" in out.stderr + out.stdout
    assert "at most 200" in out.stderr + out.stdout
