"""No hangs, no silent wrong sums, no uninvited pushes (numpy workers)."""
import json
import os
import random
import socket
import struct
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from manual_cluster import ROOT, ManualCluster, rss_mb  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "workers", "robust_worker.py")
PART = 64 * 1024
PROTOCOL_VERSION = 5  # protocol.h kProtocolVersion
FAST_FAILURE = {"BYTEPS_TIMEOUT": "3", "BYTEPS_HEARTBEAT_INTERVAL": "0.5",
                "BYTEPS_FATAL_EXIT_GRACE": "2", "BYTEPS_PARTITION_BYTES": str(PART)}


def wait_joined(tmp_path, n, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(os.path.exists(tmp_path / f"joined{r}") for r in range(n)):
            return
        time.sleep(0.05)
    raise AssertionError("workers did not join")


@pytest.mark.parametrize("victim", ["server1", "worker1", "server0"])
def test_a_dead_peer_stops_every_process_with_its_name(tmp_path, victim):
    with ManualCluster(2, 2, [WORKER, "loop", str(tmp_path)], env=FAST_FAILURE) as c:
        wait_joined(tmp_path, 2)
        time.sleep(0.5)
        procs = {"server0": c.servers[0], "server1": c.servers[1],
                 "worker0": c.workers[0], "worker1": c.workers[1]}
        killed = time.time()
        os.killpg(procs[victim].pid, 9)
        procs[victim].wait()
        survivors = {k: p for k, p in procs.items() if k != victim}
        assert c.wait_all(survivors.values(), timeout=30), "a survivor hung"
        elapsed = time.time() - killed
        assert elapsed < 15
        for name, p in survivors.items():
            assert p.returncode != 0, f"{name} exited 0 after {victim} died"
        # Server 0 also hosts the scheduler: the worker names whichever loss
        # it notices first (a push to it, which over its Unix socket fails at
        # once, or the scheduler's silence).
        expect = {"server1": ["server 1"], "worker1": ["worker 1"],
                  "server0": ["lost contact with the scheduler",
                              "sending to server 0 failed"]}[victim]
        assert any(e in c.log("worker0") for e in expect), c.log("worker0")


def test_an_idle_worker_exits_when_a_peer_dies(tmp_path):
    with ManualCluster(2, 1, [WORKER, "idle", str(tmp_path)], env=FAST_FAILURE) as c:
        wait_joined(tmp_path, 2)
        os.killpg(c.workers[1].pid, 9)
        c.workers[1].wait()
        assert c.wait_all([c.workers[0], c.servers[0]], timeout=20)
        assert c.workers[0].returncode == 1
        assert "worker 1" in c.log("worker0")


def test_a_stalled_push_pull_is_reported_then_stops_the_job(tmp_path):
    """Worker 0 push_pulls 'only_on_rank0', worker 1 'only_on_rank1': after
    BYTEPS_STALL_CHECK_TIME_SECONDS every worker logs both names and the
    missing ranks; after BYTEPS_STALL_SHUTDOWN_TIME_SECONDS their
    push_pulls fail with that message and the processes exit non-zero."""
    env = dict(FAST_FAILURE, BYTEPS_STALL_CHECK_TIME_SECONDS="2",
               BYTEPS_STALL_SHUTDOWN_TIME_SECONDS="5")
    start = time.time()
    with ManualCluster(2, 1, [WORKER, "stall", str(tmp_path)], env=env) as c:
        assert c.wait_all(c.workers + c.servers, timeout=60)
        elapsed = time.time() - start
        warning = ("tensor 'only_on_rank0' submitted by worker(s) 0 but not by worker(s) 1; "
                   "tensor 'only_on_rank1' submitted by worker(s) 1 but not by worker(s) 0")
        for r in range(2):
            log = c.log(f"worker{r}")
            assert c.workers[r].returncode == 3, log
            # the warning first, then the failure of the push_pull
            first = log.index(warning)
            assert "BYTEPS_STALL_CHECK_TIME_SECONDS=2" in log
            failure = log.index("push_pull failed: ")
            assert first < failure, log
            assert warning in log[failure:], log
            assert "BYTEPS_STALL_SHUTDOWN_TIME_SECONDS=5" in log[failure:], log
            # each worker adds what only it knows: labels, its Keras phase
            assert ("; 'only_on_rank0' is variable dense/kernel while this worker is in "
                    f"fit, epoch {r + 1}") in log[first:failure], log
        assert c.servers[0].returncode != 0
    assert elapsed < 40


def test_a_later_call_skipped_by_one_worker_is_reported_then_fails(tmp_path):
    """Worker 1 calls 'shared' a second time, worker 0 does not: that push
    waits at the server (not at the scheduler), so worker 1 itself warns
    after BYTEPS_STALL_CHECK_TIME_SECONDS and fails the push_pull after
    BYTEPS_STALL_SHUTDOWN_TIME_SECONDS, with no BYTEPS_OP_TIMEOUT set."""
    env = dict(FAST_FAILURE, BYTEPS_STALL_CHECK_TIME_SECONDS="2",
               BYTEPS_STALL_SHUTDOWN_TIME_SECONDS="5")
    with ManualCluster(2, 1, [WORKER, "skip_round", str(tmp_path), "30"], env=env) as c:
        assert c.wait_all([c.workers[1]], timeout=60)
        log = c.log("worker1")
        assert c.workers[1].returncode == 3, log
        stalled = "push_pull 'shared' (variable dense_1/bias) (call 2 of this name) has waited "
        warning = log.index(stalled)
        assert "BYTEPS_STALL_CHECK_TIME_SECONDS=2" in log[warning:], log
        failure = log.index("push_pull failed: ")
        assert warning < failure and stalled in log[failure:], log
        assert "for the other workers while this worker is in fit, epoch 4 of 10: " in log, log
        assert "BYTEPS_STALL_SHUTDOWN_TIME_SECONDS=5" in log[failure:], log


def test_no_stall_check_when_it_is_off(tmp_path):
    """BYTEPS_STALL_CHECK_TIME_SECONDS=0: no report and no shutdown; the
    lone push_pulls still wait when the workers give up (after 6 s)."""
    env = dict(FAST_FAILURE, BYTEPS_STALL_CHECK_TIME_SECONDS="0",
               BYTEPS_STALL_SHUTDOWN_TIME_SECONDS="2")
    with ManualCluster(2, 1, [WORKER, "stall", str(tmp_path), "6"], env=env) as c:
        assert c.wait_all(c.workers, timeout=60)
        for r in range(2):
            log = c.log(f"worker{r}")
            assert "push_pull failed" in log and "stalled for" not in log, log


def test_a_worker_that_left_fails_the_others_push_pulls_instead_of_hanging(tmp_path):
    with ManualCluster(2, 1, [WORKER, "leave", str(tmp_path)], env=FAST_FAILURE) as c:
        assert c.wait_all(c.workers, timeout=40)
        assert [w.returncode for w in c.workers] == [0, 0]
        with open(tmp_path / "leave.json") as f:
            res = json.load(f)
        assert res["seconds"] < 20
        for err in res["errors"]:
            assert err and "worker 1" in err and "left the job" in err, res
        assert c.wait_all(c.servers, timeout=20)


def _join_the_job(sock, token, encryption):
    """Gives a pyzmq socket this job's credentials, as a process holding the
    token derives them: its frames reach the server's frame checks (with
    BYTEPS_ENCRYPTION=1 only its checks of the link's handshake: a message
    not sealed for the link is dropped before any other check)."""
    import zmq
    from zmq.utils import z85

    from bps_tf.runtime import security
    if encryption == "curve":
        sock.curve_serverkey = zmq.curve_public(
            z85.encode(security.derive(token, "curve_server_secret")))
        secret = z85.encode(security.derive(token, "curve_client_secret"))
        sock.curve_secretkey = secret
        sock.curve_publickey = zmq.curve_public(secret)
    else:
        sock.plain_username = b"anyone"
        sock.plain_password = security.gate_password(token, 0 if encryption == "0" else 1)


def _outsiders_are_refused(port, token, encryption):
    """Processes without the token never get a frame through: one that knows
    the server's public key but not the client key (or, encryption off, holds
    a wrong credential) is refused by the server's ZAP handler; one with no
    security at all fails the handshake."""
    import zmq
    from zmq.utils import z85

    from bps_tf.runtime import security

    def knows_the_server_key(sock):
        if encryption == "curve":
            sock.curve_serverkey = zmq.curve_public(
                z85.encode(security.derive(token, "curve_server_secret")))
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        else:
            sock.plain_username = b"anyone"
            sock.plain_password = b"0" * 64

    tcp = f"tcp://127.0.0.1:{port}"
    outcomes = {"knows the server key": _handshake(tcp, knows_the_server_key),
                "no security": _handshake(tcp, lambda sock: None)}
    if encryption == "1":
        # The gate of sealed links checks no secret (nothing derived from the
        # token crosses the network): the link's handshake refuses instead
        # (test_security.py), and frames without one are dropped unread.
        assert outcomes["knows the server key"][0] == zmq.EVENT_HANDSHAKE_SUCCEEDED, outcomes
    else:
        assert outcomes["knows the server key"] == (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400), \
            outcomes
    assert outcomes["no security"][0] in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                          zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL), outcomes


def _local_endpoint(server_pid):
    """The server's Unix-socket endpoint for workers of this machine: an
    abstract name, listed in /proc/net/unix with a leading '@'."""
    prefix = f"@bps_tf-server-{server_pid}-"
    with open("/proc/net/unix") as f:
        names = {line.split()[-1] for line in f if line.split()[-1].startswith(prefix)}
    assert len(names) == 1, names
    return "ipc://" + names.pop()


def _handshake(endpoint, configure):
    """(event, value) of a DEALER's first handshake outcome at endpoint."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    configure(sock)
    monitor = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    sock.connect(endpoint)
    sock.send_multipart([b"\0" * 64, b"payload"])
    assert monitor.poll(10000), f"{endpoint}: no handshake outcome in 10 s"
    event = recv_monitor_message(monitor)
    sock.disable_monitor()
    monitor.close()
    sock.close()
    ctx.term()
    return event["event"], event["value"]


def _local_link_admits_only_the_job(server_pid, port, token, encryption):
    """The Unix-socket link is authenticated like the network one: a wrong
    credential and no security are refused, the local credential passes. The
    two credentials open only their own socket (the ZAP domain tells them
    apart; with encryption off both sockets speak PLAIN), so a credential
    captured on a network without encryption opens no local link, and the
    local one (never sent over a network) opens nothing on the TCP port."""
    import zmq
    from bps_tf.runtime import security
    local = _local_endpoint(server_pid)
    tcp = f"tcp://127.0.0.1:{port}"
    right = security.derive(token, "local_credential").hex().encode()
    network = security.gate_password(token, 0 if encryption == "0" else 1)

    def plain(password):
        def configure(sock):
            sock.plain_username = b"anyone"
            sock.plain_password = password
        return configure

    assert _handshake(local, plain(b"0" * 64)) == (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)
    assert _handshake(local, lambda sock: None)[0] in (
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    assert _handshake(local, plain(right))[0] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    assert _handshake(local, plain(network)) == (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)
    if encryption == "curve":   # the TCP port demands CURVE
        assert _handshake(tcp, plain(right))[0] in (
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    elif encryption == "0":  # PLAIN on both: only the ZAP domain keeps them apart
        assert _handshake(tcp, plain(right)) == (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)
        assert _handshake(tcp, plain(network))[0] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    else:  # the sealed links' gate admits any PLAIN hello; their handshake decides
        assert _handshake(tcp, plain(network))[0] == zmq.EVENT_HANDSHAKE_SUCCEEDED


def _hostile_frames(port, count, seed, token, encryption):
    """Random, truncated, oversized and malformed frames at a server, from a
    peer that passed the security handshake (a buggy process of the job)."""
    import zmq
    rng = random.Random(seed)
    ctx = zmq.Context()

    def dealer():
        sock = ctx.socket(zmq.DEALER)
        # close() waits until every queued frame has left (bounded): on a
        # loaded machine frames still queued at close would otherwise be lost
        # before the server can count them.
        sock.setsockopt(zmq.LINGER, 60000)
        sock.setsockopt(zmq.SNDHWM, 0)
        _join_the_job(sock, token, encryption)
        sock.connect(f"tcp://127.0.0.1:{port}")
        return sock

    sock = dealer()
    # Frames over the server's size limit make libzmq drop the connection:
    # they go on their own socket so the others' delivery does not depend on
    # when that happens.
    oversized = dealer()
    magic, version = 0x31535042, PROTOCOL_VERSION
    for i in range(count):
        kind = i % 6
        if kind == 0:  # random bytes, random frame count
            frames = [rng.randbytes(rng.randint(0, 200)) for _ in range(rng.randint(1, 4))]
        elif kind == 1:  # truncated header
            frames = [struct.pack("<IHH", magic, version, 7)[: rng.randint(0, 8)], b""]
        elif kind == 2:  # a well-formed push claiming many GiB
            hdr = struct.pack("<IHHiHHQQQQ16s", magic, version, 7, rng.randint(0, 1), 0, 2,
                              rng.getrandbits(64), 0, 0, 40 << 30, b"\0" * 16)
            frames = [hdr, rng.randbytes(64)]
        elif kind == 3:  # consistent sizes, reserved bytes not zero
            payload = rng.randbytes(rng.randint(0, 4096))
            hdr = struct.pack("<IHHiHHQQQQ16s", magic, version, rng.choice([1, 5, 7, 9, 11]),
                              rng.randint(-1, 3), rng.randint(0, 3), rng.randint(0, 9),
                              rng.getrandbits(64), rng.getrandbits(8), 0, len(payload),
                              rng.randbytes(15) + b"\1")
            frames = [hdr, payload]
        elif kind == 4:  # right size, random contents
            frames = [rng.randbytes(64), rng.randbytes(rng.randint(0, 300))]
        elif i % 60 == 5:  # more than the server accepts in one frame
            oversized.send_multipart([b"\0" * 64, b"\0" * (PART + 8192)])
            continue
        else:
            frames = [b"x" * 64]
        sock.send_multipart(frames)
    sock.close()
    oversized.close(linger=0)
    ctx.term()
    # Plain TCP garbage too (not even ZMTP).
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(rng.randbytes(rng.randint(1, 5000)))


@pytest.mark.parametrize("encryption", ["1", "curve", "0"])
def test_hostile_frames_are_dropped_and_sums_stay_exact(tmp_path, encryption):
    release = tmp_path / "attack_done"
    env = dict(FAST_FAILURE, BYTEPS_TIMEOUT="30", BYTEPS_LOG_LEVEL="WARNING",
               BYTEPS_ENCRYPTION=encryption, ROBUST_WAIT_FOR_FILE=str(release))
    with ManualCluster(2, 1, [WORKER, "exact", str(tmp_path), "400"], env=env) as c:
        token = c.base["BYTEPS_JOB_TOKEN"]
        wait_joined(tmp_path, 2)
        rss_before = rss_mb(c.servers[0].pid)
        # The workers finish their rounds and then wait for `release`, so the
        # server is still listening for every frame below, however fast they are.
        _outsiders_are_refused(c.port, token, encryption)
        _local_link_admits_only_the_job(c.servers[0].pid, c.port, token, encryption)
        _hostile_frames(c.port, 10000, seed=7, token=token, encryption=encryption)
        rss_after = rss_mb(c.servers[0].pid)
        release.touch()
        assert c.wait_all(c.workers, timeout=120)
        assert [w.returncode for w in c.workers] == [0, 0]
        for r in range(2):
            with open(tmp_path / f"rank{r}.json") as f:
                assert json.load(f)["bad"] == []
        assert c.wait_all(c.servers, timeout=20)
        assert c.servers[0].returncode == 0
        log = c.log("server0")
        dropped = int(log.split("dropped ")[1].split()[0])
        assert dropped >= 9000, log
        # the two outsiders (and the raw TCP garbage) never got a frame in
        refused = int(log.split("refused ")[-1].split()[0])
        assert refused >= 5, log  # and the three on the Unix socket
        assert "refused a connection on tcp://127.0.0.1:" in log, log
        assert rss_after - rss_before < 100, (rss_before, rss_after)


def _hello_from_another_release(port, token, version):
    """Says HELLO to the scheduler as a worker of a release speaking protocol
    `version` would, and returns the frames that come back within 10 s."""
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    _join_the_job(sock, token, "1")
    sock.connect(f"tcp://127.0.0.1:{port}")
    payload = b"hostname=elsewhere\npid=1\n"
    hdr = struct.pack("<IHHiHHQQQQIBQ3s", 0x31535042, version, 1, 0, 0, 0, 0, 0, 0,
                      len(payload), 0, 0, 0, b"\0" * 3)
    assert len(hdr) == 64
    sock.send_multipart([hdr, payload])
    frames = sock.recv_multipart() if sock.poll(10000) else None
    sock.close()
    ctx.term()
    return frames


def test_a_node_of_another_release_is_told_why_and_the_job_goes_on(tmp_path):
    """A HELLO in another protocol version is answered at once with an ERROR
    the sender can read (stamped in its own version) that names both
    versions, the scheduler logs it, and the job's own workers are unaffected."""
    answers = {}

    def before_workers(port):
        answers["reply"] = _hello_from_another_release(port, c_token, version=3)
        return {}

    c_token = "feedface" * 4
    env = dict(FAST_FAILURE, BYTEPS_TIMEOUT="30", BYTEPS_ENCRYPTION="1")
    with ManualCluster(1, 1, [WORKER, "exact", str(tmp_path), "20"], env=env, token=c_token,
                       before_workers=before_workers) as c:
        assert c.wait_all(c.workers, timeout=120)
        assert c.workers[0].returncode == 0, c.log("worker0")
        with open(tmp_path / "rank0.json") as f:
            assert json.load(f)["bad"] == []
        assert c.wait_all(c.servers, timeout=20)
        log = c.log("server0")
    reply = answers["reply"]
    assert reply is not None, "no answer to a HELLO of another release in 10 s: " + log
    header, text = reply
    magic, version, msg_type = struct.unpack("<IHH", header[:8])
    assert (magic, version, msg_type) == (0x31535042, 3, 13)  # kError, in the sender's version
    text = text.decode()
    assert "mixed bps_tf releases" in text and "version 3" in text, text
    assert f"speaks version {PROTOCOL_VERSION}" in text, text
    assert "mixed bps_tf releases" in log, log


@pytest.mark.parametrize("intruder, reason", [
    ({"BYTEPS_JOB_TOKEN": "not-the-job-token"}, "holds another BYTEPS_JOB_TOKEN"),
    ({"BYTEPS_ENCRYPTION": "0"}, "BYTEPS_ENCRYPTION=0"),
    ({"BYTEPS_JOB_TOKEN": ""}, "BYTEPS_JOB_TOKEN is not set"),
], ids=["wrong-token", "encryption-off", "no-token"])
def test_a_worker_without_the_token_cannot_join(tmp_path, intruder, reason):
    """A worker (then a server) whose token or encryption setting differs from
    the scheduler's fails its handshake: it stops at once with the reason
    (long before the rendezvous timeout), and the scheduler's server says it
    refused a connection."""
    env = dict(FAST_FAILURE, BYTEPS_RENDEZVOUS_TIMEOUT="60")
    with ManualCluster(2, 1, [WORKER, "loop", str(tmp_path)], env=env) as c:
        # Replace worker 1 by one holding another token.
        os.killpg(c.workers[1].pid, 9)
        c.workers[1].wait()
        c.base.update(intruder)
        started = time.time()
        c.workers[1] = c._start("intruder", [sys.executable, WORKER, "loop", str(tmp_path)],
                                {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "1",
                                 "DMLC_PS_ROOT_PORT": str(c.port)})
        assert c.wait_all([c.workers[1]], timeout=30)
        assert time.time() - started < 20
        assert c.workers[1].returncode != 0
        log = c.log("intruder")
        assert "could not meet the cluster: the connection to tcp://127.0.0.1:" in log, log
        assert "was refused" in log and reason in log, log
        assert "set BYTEPS_JOB_TOKEN and BYTEPS_ENCRYPTION the same on every node" in log, log
        assert not os.path.exists(tmp_path / "joined1")
        assert "refused a connection on" in c.log("server0")
        # A server with the same settings fails the same way.
        started = time.time()
        server = c._start("intruding_server", [sys.executable, "-m", "bps_tf.server"],
                          {"DMLC_ROLE": "server", "BYTEPS_SERVER_ID": "0",
                           "DMLC_PS_ROOT_PORT": str(c.port)})
        c.servers.append(server)
        assert c.wait_all([server], timeout=30)
        assert time.time() - started < 20
        assert server.returncode != 0
        log = c.log("intruding_server")
        assert "server 0 could not meet the cluster: the connection to tcp://127.0.0.1:" in log, log
        assert reason in log, log


def test_a_taken_port_is_a_clear_error(tmp_path):
    import subprocess
    import tempfile
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        env = dict(os.environ, DMLC_ROLE="server", DMLC_NUM_WORKER="1", DMLC_NUM_SERVER="1",
                   BYTEPS_SERVER_ID="0", BYTEPS_HOST_SCHEDULER="1", DMLC_PS_ROOT_URI="127.0.0.1",
                   DMLC_PS_ROOT_PORT=str(port), BYTEPS_BIND_HOST="127.0.0.1")
        env.pop("TF_CONFIG", None)
        proc = subprocess.run([sys.executable, "-m", "bps_tf.server"], env=env, timeout=30,
                              capture_output=True, text=True, cwd=tempfile.gettempdir())
    assert proc.returncode != 0
    assert "port already taken" in proc.stderr and str(port) in proc.stderr, proc.stderr


def _wait_for(path, procs, timeout):
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert time.time() < deadline and all(p.poll() is None for p in procs), path
        time.sleep(0.05)


def test_soak_short_exact_and_memory_flat(tmp_path):
    # Six busy processes share the machine here (more under CI's load): a
    # peer is declared dead after 120 s of silence instead of 30, so a
    # starved process is not mistaken for a dead one; a real hang still
    # fails the bounds below.
    env = {"BYTEPS_PARTITION_BYTES": str(PART), "BYTEPS_TIMEOUT": "120"}
    with ManualCluster(4, 2, [WORKER, "exact", str(tmp_path), "1500"], env=env) as c:
        _wait_for(tmp_path / "warm0", c.servers + c.workers, 300)
        servers_warm = [rss_mb(s.pid) for s in c.servers]
        _wait_for(tmp_path / "rank0.json", c.servers, 600)
        servers_end = [rss_mb(s.pid) for s in c.servers]
        assert c.wait_all(c.workers, timeout=300)
        assert [w.returncode for w in c.workers] == [0, 0, 0, 0]
        for r in range(4):
            with open(tmp_path / f"rank{r}.json") as f:
                res = json.load(f)
            assert res["bad"] == []
            assert res["rss"]["end"] - res["rss"]["warm"] < 10, res["rss"]
        for warm, end in zip(servers_warm, servers_end):
            assert end - warm < 10, (servers_warm, servers_end)
        # Bounds, not speed goals: generous enough for a machine under load.
        assert c.wait_all(c.servers, timeout=120), "servers did not exit after the job"
        assert [s.returncode for s in c.servers] == [0, 0]
