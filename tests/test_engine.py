"""The core engine across processes, with numpy workers (no TensorFlow).

Each test launches one small local cluster with bpslaunch; numpy workers
and servers start in well under a second.
"""
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_runner import ROOT, launch, results  # noqa: E402

CHECKS = os.path.join(ROOT, "tests", "workers", "engine_checks.py")
PART = 64 * 1024  # small partitions keep "3 partitions + 1 byte" cheap


def run_checks(tmp_path, mode, workers=3, servers=2, env=None, expect_ok=True, part=PART):
    out = str(tmp_path)
    env = dict({"BYTEPS_PARTITION_BYTES": str(part)} if part else {}, **(env or {}))
    proc = launch(workers, servers, [CHECKS, mode, out], env=env)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return results(out), proc


def _unix_sockets_visible():
    from bps_tf.runtime.loader import load_core
    return bool(load_core().machine_netns_id()) and os.path.exists("/proc/net/unix")


def test_sums_exact_for_every_dtype_and_size(tmp_path):
    res, _ = run_checks(tmp_path, "sums")
    assert sorted(res) == [0, 1, 2]
    for rank, r in res.items():
        assert r["size"] == 3 and r["rank"] == rank
        assert r["local_size"] == 3 and r["local_rank"] == rank
        assert r["cross_size"] == 1 and r["cross_rank"] == 0   # one host
        assert r["checked"] == 6 * 5 + 50
        assert r["bad"] == []
        assert r["stats"]["frames_dropped"] == 0
        # Both servers are on this machine: reached over Unix sockets
        # (BYTEPS_ENABLE_IPC) wherever the kernel lets a process see its
        # machine id and its namespace's sockets (not in every sandbox);
        # TCP_NOTSENT_LOWAT on the scheduler's TCP link.
        assert r["stats"]["links_local"] == (2 if _unix_sockets_visible() else 0), r["stats"]
        assert r["stats"]["connections_capped"] >= 1, r["stats"]


def test_tcp_everywhere_when_unix_sockets_are_off(tmp_path):
    res, _ = run_checks(tmp_path, "sums", workers=2, env={"BYTEPS_ENABLE_IPC": "0"})
    assert sorted(res) == [0, 1]
    for r in res.values():
        assert r["bad"] == [] and r["checked"] == 6 * 5 + 50
        assert r["stats"]["links_local"] == 0, r["stats"]
        # TCP_NOTSENT_LOWAT on its connections to the scheduler and 2 servers
        assert r["stats"]["connections_capped"] >= 3, r["stats"]


def test_min_max_product_on_the_servers_exact_for_every_dtype(tmp_path):
    res, _ = run_checks(tmp_path, "reduce")
    assert sorted(res) == [0, 1, 2]
    for r in res.values():
        assert r["bad"] == []
        assert "compression" in r["compression_error"]
        assert "asynchronous" in r["async_error"]


def test_join_scheduler_and_stall_check_skip_the_joined_worker(tmp_path):
    res, proc = run_checks(tmp_path, "join", env={"BYTEPS_STALL_CHECK_TIME_SECONDS": "1"})
    assert sorted(res) == [0, 1, 2]
    assert res[1]["sum"] == res[2]["sum"] == [5] * 4   # workers 1 and 2 only
    lasts = {r["last"] for r in res.values()}
    assert len(lasts) == 1 and lasts <= {1, 2}, lasts
    assert all(r["after"] == [6, 6] for r in res.values())
    stalls = re.findall(r"tensor 'join/late' submitted by worker\(s\) ([\d, ]+) but not by "
                        r"worker\(s\) ([\d, ]+)", proc.stderr)
    assert stalls, proc.stderr[-3000:]
    # Worker 0 had joined: never reported as missing.
    assert all(missing.strip() == "2" for _, missing in stalls), stalls


def test_a_joined_worker_that_hangs_is_still_reported(tmp_path):
    res, proc = run_checks(tmp_path, "join_lost", expect_ok=False,
                           env={"BYTEPS_TIMEOUT": "3", "BYTEPS_HEARTBEAT_INTERVAL": "0.5"})
    assert proc.returncode != 0
    assert res[0] == {"rank": 0, "stopping": True}
    for r in (1, 2):
        # worker 0 had joined: 1 + 2, step after step
        assert res[r]["sums"] and all(s == [3, 3, 3] for s in res[r]["sums"]), res[r]
    # The scheduler reports the joined worker once its heartbeats stop, and
    # the workers still training fail with that report.
    for who in ("server 0", "worker 1", "worker 2"):
        assert re.search(rf"\[{who}\].*lost worker 0 .*no heartbeat", proc.stderr), \
            proc.stderr[-3000:]


def test_partitions_leave_in_priority_order_under_small_credit(tmp_path):
    res, _ = run_checks(tmp_path, "priority", workers=2, servers=1,
                        env={"BYTEPS_SCHEDULING_CREDIT": str(PART), "BYTEPS_DEBUG_SEND_LOG": "1",
                             "BYTEPS_TCP_NOTSENT_LOWAT": "0"})
    assert [r["stats"]["connections_capped"] for r in res.values()] == [0, 0]  # turned off
    log = res[0]["send_log"]
    assert len(log) == 12  # 6 tensors x 2 partitions
    prios = [prio for _, _, prio in log]
    assert prios == sorted(prios, reverse=True), log
    assert [(name, part) for name, part, _ in log[:2]] == [("prio/3", 0), ("prio/3", 1)]
    assert sorted((name, part) for name, part, _ in log) == sorted(
        (f"prio/{i}", p) for i in range(6) for p in range(2))


def test_shape_mismatch_is_an_error_on_every_worker(tmp_path):
    res, _ = run_checks(tmp_path, "mismatch", workers=2, servers=1)
    for r in res.values():
        err = r["error"]
        assert err is not None
        assert "'mismatch'" in err and "float32[3,4]" in err and "float32[4,3]" in err
        assert r["after"] == [2.0] * 5  # other tensors still work
        assert "twice" in r["twice_error"] and "in flight" in r["twice_error"]


def test_a_slow_worker_never_mixes_rounds(tmp_path):
    res, _ = run_checks(tmp_path, "rounds", workers=2, servers=2)
    assert [r["bad_rounds"] for r in res.values()] == [0, 0]


def test_async_keys_server_keeps_and_adds(tmp_path):
    # Per key, not per server: no BYTEPS_ENABLE_ASYNC on any node.
    res, _ = run_checks(tmp_path, "async", workers=2, servers=1)
    for r in res.values():
        assert r["sync_beside"] == [2.0] * 4
        seen = r["seen"]
        assert seen == sorted(seen) and seen[0] >= 1  # running totals
        assert r["final"] == 10.0  # 2 workers x 5 pushes of ones
    errors = [r["async_shape_error"] for r in res.values() if r["async_shape_error"]]
    assert len(errors) == 1 and "differs across workers" in errors[0], errors
    assert "float32[3,4]" in errors[0] and "float32[4,3]" in errors[0]


def test_settings_disagreement_names_setting_and_both_values(tmp_path):
    res, proc = run_checks(tmp_path, "settings", workers=2, servers=1,
                           env={"BYTEPS_RENDEZVOUS_TIMEOUT": "20"}, expect_ok=False)
    errors = [r["init_error"] for r in res.values()]
    assert errors, proc.stderr
    for err in errors:
        assert "partition_bytes" in err and str(PART) in err and "1024" in err
    assert proc.returncode != 0  # the server reports the failed job


def test_a_link_rate_on_every_node_sizes_the_partitions_and_sums_stay_exact(tmp_path):
    """BYTEPS_LINK_RATE=100mbit gives 32 KiB partitions on every node (the
    scheduler places them, the servers take them); tensors of several
    partitions and a last partial one sum exactly."""
    res, _ = run_checks(tmp_path, "sums", workers=2, env={"BYTEPS_LINK_RATE": "100mbit"},
                        part=None)
    assert len(res) == 2
    for r in res.values():
        assert r["partition_bytes"] == 32768, r
        assert r["bad"] == [] and r["checked"] > 50, r


def test_a_link_rate_given_to_some_nodes_only_is_named(tmp_path):
    res, proc = run_checks(tmp_path, "settings_link_rate", workers=2, servers=1,
                           env={"BYTEPS_RENDEZVOUS_TIMEOUT": "20"}, expect_ok=False, part=None)
    errors = [r["init_error"] for r in res.values()]
    assert errors, proc.stderr
    for err in errors:
        assert "partition_bytes" in err and "32768" in err and "1048576" in err, err
        assert "BYTEPS_LINK_RATE" in err, err
    assert proc.returncode != 0


def test_a_tensor_of_too_many_partitions_is_refused_naming_both_settings(tmp_path):
    # 65,536 partitions of 64 bytes: the scheduler refuses the declaration
    # with the numbers and the two settings that size partitions; the engine
    # goes on with the next tensor.
    res, _ = run_checks(tmp_path, "too_many_parts", workers=2, servers=1, part=64)
    assert sorted(res) == [0, 1]
    for r in res.values():
        err = r["error"]
        assert err and "too_many_parts" in err, err
        assert "65536 partitions of 64 bytes, more than the 65535" in err, err
        assert "BYTEPS_PARTITION_BYTES" in err and "BYTEPS_LINK_RATE" in err, err
        assert r["after"] == [3.0] * 40, r


def test_zmq_constants_match_pyzmq():
    zmq = pytest.importorskip("zmq")
    with open(os.path.join(ROOT, "bps_tf", "core", "transport", "zmq_api.h")) as f:
        text = f.read()
    ours = {m.group(1): int(m.group(2))
            for m in re.finditer(r"constexpr int k(\w+) = (\d+);", text)}
    names = {"Pair": zmq.PAIR, "Rep": zmq.REP,
             "Dealer": zmq.DEALER, "Router": zmq.ROUTER, "DontWait": zmq.DONTWAIT,
             "SndMore": zmq.SNDMORE, "PollIn": zmq.POLLIN, "PollOut": zmq.POLLOUT,
             "RoutingId": zmq.ROUTING_ID, "SndBuf": zmq.SNDBUF, "RcvBuf": zmq.RCVBUF,
             "Fd": zmq.FD, "Events": zmq.EVENTS, "Linger": zmq.LINGER, "ReconnectIvl": zmq.RECONNECT_IVL, "Backlog": zmq.BACKLOG,
             "MaxMsgSize": zmq.MAXMSGSIZE, "SndHwm": zmq.SNDHWM,
             "RcvHwm": zmq.RCVHWM, "LastEndpoint": zmq.LAST_ENDPOINT,
             "RouterMandatory": zmq.ROUTER_MANDATORY, "IoThreads": zmq.IO_THREADS,
             "MaxSockets": zmq.MAX_SOCKETS, "SocketLimit": zmq.SOCKET_LIMIT,
             "PlainServer": zmq.PLAIN_SERVER, "PlainUsername": zmq.PLAIN_USERNAME,
             "PlainPassword": zmq.PLAIN_PASSWORD, "CurveServer": zmq.CURVE_SERVER,
             "CurvePublicKey": zmq.CURVE_PUBLICKEY, "CurveSecretKey": zmq.CURVE_SECRETKEY,
             "CurveServerKey": zmq.CURVE_SERVERKEY, "ZapDomain": zmq.ZAP_DOMAIN,
             "EventConnected": zmq.EVENT_CONNECTED, "EventAccepted": zmq.EVENT_ACCEPTED,
             "EventClosed": zmq.EVENT_CLOSED, "EventDisconnected": zmq.EVENT_DISCONNECTED,
             "EventHandshakeFailedNoDetail": zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
             "EventHandshakeSucceeded": zmq.EVENT_HANDSHAKE_SUCCEEDED,
             "EventHandshakeFailedProtocol": zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
             "EventHandshakeFailedAuth": zmq.EVENT_HANDSHAKE_FAILED_AUTH,
             "ProtocolErrorCryptographic": zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC,
             "ProtocolErrorMechanismMismatch": zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH}
    assert set(names) | {"Hausnumero"} >= set(ours), "a constant the test does not check"
    for name, value in names.items():
        assert ours[name] == int(value), name
    assert ours["Hausnumero"] + 53 == int(zmq.ETERM)


def test_no_wake_up_of_an_io_thread_is_lost():
    # The I/O loops sleep in poll() on an eventfd that other threads write
    # when they queue work. A lost wake-up does not fail anything: it makes
    # every later message wait out the poll timeout (100 ms), which once
    # made a small model's fit step 20x slower. 200,000 notifications with
    # a consumer that polls, drains and takes the queue, as the loops do:
    # none of its polls may time out while an item is queued.
    from bps_tf.runtime.loader import load_core
    assert load_core().wakeup_lost_count(200_000, 50) == 0


def test_a_wait_finds_a_message_whose_signal_a_send_took_in():
    """The channel polls libzmq's signal fds itself (one poll for all its
    sockets) and asks libzmq again about a socket it sent on: a send takes
    in the command that announced a message already there, whose fd then
    stays quiet. 300 ping-pongs with such a send before each wait: none
    may wait out its 1,000 ms for a message that had arrived."""
    from bps_tf.runtime.loader import load_core
    assert load_core().channel_slow_waits(300, 1000) == 0


def test_a_unix_socket_counts_as_local_only_when_it_listens_here():
    # A worker takes a server's ipc:// endpoint only when the server has its
    # machine id (boot id + network namespace) and the name is listed here;
    # a name that only looked local would leave the connection retrying
    # forever, so it falls back to TCP.
    import uuid

    import zmq
    from bps_tf.runtime.loader import load_core
    core = load_core()
    ident = core.machine_netns_id()
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert ident.startswith(f.read().strip() + " net:["), ident
    name = f"ipc://@bps_tf-test-{uuid.uuid4().hex}"
    assert not core.abstract_endpoint_listed(name)
    welcome = (f"server.0=tcp://127.0.0.1:1\nserver.0.local={name}\n"
               f"server.0.machine={ident}\nserver.1=tcp://127.0.0.1:2\n")
    # The same machine id, but nothing listens under that name: TCP.
    assert core.server_endpoint(welcome, 0, ident) == ("tcp://127.0.0.1:1", False)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.bind(name)
        assert core.abstract_endpoint_listed(name)
        assert not core.abstract_endpoint_listed(name + "x")
        assert not core.abstract_endpoint_listed("tcp://127.0.0.1:1")
        assert core.server_endpoint(welcome, 0, ident) == (name, True)
        # Another machine (or namespace), IPC off (""), or no Unix socket: TCP.
        assert core.server_endpoint(welcome, 0, ident + "x") == ("tcp://127.0.0.1:1", False)
        assert core.server_endpoint(welcome, 0, "") == ("tcp://127.0.0.1:1", False)
        assert core.server_endpoint(welcome, 1, ident) == ("tcp://127.0.0.1:2", False)
    finally:
        sock.close(linger=0)
        ctx.term()
    assert not core.abstract_endpoint_listed(name)


def test_the_last_to_join_is_the_latest_notice_no_other_worker_saw_join():
    # The scheduler reads JOIN_NOTICEs from different workers in turn, not
    # in the order they were sent. Worker 0's notice came first here although
    # its results had counted workers 1 and 2 as joined (seen = 0b110):
    # worker 0 joined last. Workers whose joins nothing ordered: the later
    # arrival is last.
    from bps_tf.runtime.loader import load_core
    core = load_core()
    assert core.last_to_join([(2, 0), (0, 0b110), (1, 0b100)]) == 0
    assert core.last_to_join([(1, 0b001), (0, 0)]) == 1
    assert core.last_to_join([(0, 0), (1, 0)]) == 1
    assert core.last_to_join([(1, 0), (0, 0)]) == 0


def test_a_worker_that_crashes_by_a_signal_prints_where_it_was(tmp_path):
    """bpslaunch's children run with Python's fault handler: a worker killed
    by SIGSEGV prints its Python stack, so a crash in a job is not silent."""
    script = tmp_path / "crash.py"
    script.write_text("import ctypes\n\n\ndef crash_here():\n    ctypes.string_at(0)\n\n\n"
                      "crash_here()\n")
    proc = launch(1, 1, [str(script)], timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "SIGSEGV" in out, out
    assert "Fatal Python error: Segmentation fault" in out and "crash_here" in out, out
