"""Connection security: keys derived from the job token, what reaches the
core, and what an observer of the wire sees (numpy workers, no TensorFlow).

The wrong-token and hostile-frame clusters are in test_robustness.py.
"""
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from manual_cluster import ROOT, ManualCluster  # noqa: E402

from bps_tf.runtime import config, security  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "workers", "robust_worker.py")
PATTERN_VALUE = 1234.5678
ROUNDS = 20
TENSOR_BYTES = 64 * 1024 * 4  # robust_worker.py's pattern tensor


def test_secrets_are_derived_per_token_and_per_purpose():
    names = sorted(security.LABELS)
    keys = {name: security.derive("token-a", name) for name in names}
    assert all(len(k) == 32 for k in keys.values())
    assert len(set(keys.values())) == len(names)          # one secret per purpose
    assert keys == {name: security.derive("token-a", name) for name in names}  # stable
    assert all(security.derive("token-b", n) != keys[n] for n in names)
    with pytest.raises(ValueError, match="no job token"):
        security.derive("", "plain_credential")


def test_the_token_is_stretched_by_a_memory_hard_derivation():
    """Whatever crosses the network can be recorded and used to test guesses
    of the token offline: each guess costs a scrypt of 16 MiB
    (docs/reliability.md#security), then one HMAC per purpose."""
    import hashlib
    import hmac
    master = hashlib.scrypt(b"token-a", salt=b"bps_tf job token v2", n=1 << 14, r=8, p=1,
                            maxmem=64 << 20, dklen=32)
    for name, label in security.LABELS.items():
        assert security.derive("token-a", name) == hmac.new(master, label,
                                                            hashlib.sha256).digest()


@pytest.mark.parametrize("env, mode, keys", [
    # with a token, the local links' credential too (Unix sockets on one machine)
    # sealed links: nothing for the gate (a public label), the handshake's key
    ({"BYTEPS_JOB_TOKEN": "s3cr3t"}, "aead", {"link_key", "local_credential"}),
    ({"BYTEPS_JOB_TOKEN": "s3cr3t", "BYTEPS_ENCRYPTION": "curve"}, "curve",
     {"curve_server_secret", "curve_client_secret", "local_credential"}),
    ({"BYTEPS_JOB_TOKEN": "s3cr3t", "BYTEPS_ENCRYPTION": "0"}, "plain",
     {"plain_credential", "local_credential"}),
    ({"BYTEPS_ENCRYPTION": "1"}, "none", set()),
])
def test_the_core_gets_derived_keys_never_the_token(env, mode, keys):
    values = config.core_settings(env)
    assert values["link_security"] == mode
    secret_keys = {"curve_server_secret", "curve_client_secret", "plain_credential",
                   "local_credential", "link_key"}
    assert secret_keys & set(values) == keys
    text = config.to_core_text(values)
    assert "s3cr3t" not in text and "job_token" not in text
    for key in keys:
        assert len(values[key]) == 64 and int(values[key], 16) >= 0


def test_a_bad_encryption_value_is_refused():
    with pytest.raises(ValueError, match="BYTEPS_ENCRYPTION='maybe' is not valid"):
        config.core_settings({"BYTEPS_JOB_TOKEN": "t", "BYTEPS_ENCRYPTION": "maybe"})


def test_the_core_refuses_malformed_keys():
    # In a fresh process: a core another test of this session has already
    # initialized would not look at a new config at all.
    script = """
from bps_tf.runtime import basics
core = basics.core()
text = ("role=worker\\nnum_workers=2\\nnum_servers=1\\nscheduler_port=1\\n"
        "link_security=curve\\ncurve_server_secret=xyz\\n")
for bad in (text, text.replace("=curve", "=maybe")):
    try:
        core.worker_init(bad)
    except RuntimeError as exc:
        print("refused:", exc)
    else:
        print("accepted")
print("initialized:", core.is_initialized())
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=tempfile.gettempdir())
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 3, proc.stdout
    assert lines[0].startswith("refused:") and "curve_server_secret as 64 hex digits" in lines[0]
    assert lines[1].startswith("refused:") and "link_security must be none, plain, aead or curve" in lines[1]
    assert lines[2] == "initialized: False"


class TapProxy:
    """A TCP relay that keeps a copy of every byte it passes on, per
    connection and direction: what anyone on the path could read."""

    def __init__(self, listen, target):
        self.target = target
        self.server = socket.create_server(listen)
        self.server.settimeout(0.2)
        self.lock = threading.Lock()
        self.captured = []  # (direction, bytearray)
        self.sockets = []
        self.closing = threading.Event()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self):
        while not self.closing.is_set():
            try:
                client, _ = self.server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            upstream = socket.create_connection(self.target, timeout=10)
            client.settimeout(None)
            upstream.settimeout(None)
            with self.lock:
                self.sockets += [client, upstream]
            for src, dst, direction in ((client, upstream, "to server"),
                                        (upstream, client, "to worker")):
                record = bytearray()
                with self.lock:
                    self.captured.append((direction, record))
                t = threading.Thread(target=self._pump, args=(src, dst, record), daemon=True)
                t.start()
                self.threads.append(t)

    def _pump(self, src, dst, record):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                record += data
                dst.sendall(data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def bytes_seen(self, direction):
        with self.lock:
            return sum(len(r) for d, r in self.captured if d == direction)

    def contains(self, needle):
        with self.lock:
            return any(needle in r for _, r in self.captured)

    def close(self):
        self.closing.set()
        self.server.close()
        with self.lock:
            for s in self.sockets:
                s.close()
        for t in self.threads:
            t.join(timeout=10)


@pytest.mark.parametrize("encryption", ["1", "0"])
def test_payloads_are_not_readable_on_the_wire_with_encryption(tmp_path, encryption):
    """Every byte between the workers and the server (scheduler included)
    passes a relay on 127.0.0.2 that records it. A float32 tensor filled with
    one value is push_pulled: its bytes (and those of the sum) show in the
    recording with BYTEPS_ENCRYPTION=0, and nowhere with encryption on."""
    proxy = []

    def start_proxy(port):
        # The server listens on 127.0.0.1 and tells the workers 127.0.0.2
        # (DMLC_NODE_HOST), where the relay waits on the same port.
        proxy.append(TapProxy(("127.0.0.2", port), ("127.0.0.1", port)))
        return {"DMLC_PS_ROOT_URI": "127.0.0.2"}

    # The network path is under test: Unix sockets (BYTEPS_ENABLE_IPC, on by
    # default for a server on the worker's machine) would go around the relay.
    env = {"BYTEPS_ENCRYPTION": encryption, "PATTERN_VALUE": str(PATTERN_VALUE),
           "BYTEPS_ENABLE_IPC": "0"}
    try:
        with ManualCluster(2, 1, [WORKER, "pattern", str(tmp_path), str(ROUNDS)], env=env,
                           server_env={"DMLC_NODE_HOST": "127.0.0.2"},
                           before_workers=start_proxy) as c:
            assert c.wait_all(c.workers + c.servers, timeout=120)
            assert [p.returncode for p in c.workers + c.servers] == [0, 0, 0], \
                c.log("worker0") + c.log("server0")
        for r in range(2):
            with open(tmp_path / f"rank{r}.json") as f:
                assert json.load(f)["bad"] == []
    finally:
        for p in proxy:
            p.close()
    tap = proxy[0]
    # All the data went through the relay, not around it.
    assert tap.bytes_seen("to server") >= 2 * ROUNDS * TENSOR_BYTES
    assert tap.bytes_seen("to worker") >= 2 * ROUNDS * TENSOR_BYTES
    pushed = struct.pack("<f", PATTERN_VALUE) * 16
    summed = struct.pack("<f", PATTERN_VALUE * 2) * 16
    if encryption == "1":
        assert not tap.contains(pushed) and not tap.contains(summed)
    else:
        assert tap.contains(pushed) and tap.contains(summed)


# ---- sealed links (BYTEPS_ENCRYPTION=1): core/transport/link_cipher.h ----


@pytest.mark.parametrize("partition,threads", [(64 << 10, "0"), (1 << 20, "4")],
                         ids=["one-thread", "sliced"])
def test_sealed_links_give_exact_sums_over_tcp_with_two_servers(tmp_path, partition, threads):
    """Every link sealed (TCP only: BYTEPS_ENABLE_IPC=0), two servers, tensors
    of five dtypes from 0 bytes to 3 partitions: every sum is exact, no
    message is rejected, and each process says what it seals with. With
    1 MiB partitions and BYTEPS_CIPHER_THREADS=4 large messages are sealed
    in slices by several threads. A sum sent to both workers is encrypted
    once for both (link_cipher.h SharedSeal)."""
    env = {"BYTEPS_ENCRYPTION": "1", "BYTEPS_ENABLE_IPC": "0",
           "BYTEPS_PARTITION_BYTES": str(partition), "BYTEPS_CIPHER_THREADS": threads,
           "BYTEPS_LOG_LEVEL": "INFO"}
    with ManualCluster(2, 2, [WORKER, "exact", str(tmp_path), "120"], env=env) as c:
        assert c.wait_all(c.workers + c.servers, timeout=120), "a process hung"
        codes = [p.returncode for p in c.workers + c.servers]
        logs = {n: c.log(n) for n in ("worker0", "worker1", "server0", "server1")}
    assert codes == [0, 0, 0, 0], logs
    for r in range(2):
        with open(tmp_path / f"rank{r}.json") as f:
            result = json.load(f)
        assert result["bad"] == [], result["bad"]
        assert result["stats"]["frames_rejected"] == 0, result["stats"]
        # The replies were decrypted into the outputs, not copied there after.
        assert result["stats"]["replies_decrypted_to_output"] > 0, result["stats"]
        sliced = result["stats"]["messages_sealed_in_slices"]
        assert (sliced > 0) if threads == "4" else (sliced == 0), result["stats"]
        # Each sum that went to both workers was encrypted once for both.
        assert result["stats"]["messages_opened_shared"] > 0, result["stats"]
    for name, log in logs.items():
        line = [x for x in log.splitlines() if "sealed links (BYTEPS_ENCRYPTION=1)" in x]
        assert line and any(s in line[0] for s in SUITES), (name, log[-2000:])


# A push's header (protocol.h FrameHeader), as the worker sends it.
HEADER = struct.pack("<IHHiHHQQQQIBQ3s", 0x31535042, 4, 7, 1, 0, 2, 0xABCDEF0001, 3, 0, 4096,
                     0, 0, 0, b"\0" * 3)
SUITES = {"AEGIS-128L", "AEGIS-256", "AES-256-GCM", "XChaCha20-Poly1305"}


def _core():
    from bps_tf.runtime import basics
    return basics.core()


def _link(client_key=None, server_key=None):
    """Both ends of one link after its handshake: (connecting, listening)."""
    key = os.urandom(32)
    client = _core().LinkEnd(client_key or key)
    server = _core().LinkEnd(server_key or key)
    client.finish(server.answer(client.hello()))
    return client, server


@pytest.mark.parametrize("size", [0, 1, 4096, 1 << 20])
def test_a_sealed_link_carries_messages_both_ways_unreadable_to_others(size):
    client, server = _link()
    assert client.suite == server.suite and client.suite in SUITES
    payload = struct.pack("<f", PATTERN_VALUE) * (size // 4) + b"x" * (size % 4)
    for sender, receiver in ((client, server), (server, client)):
        sealed, cipher = sender.seal(HEADER, payload)
        assert len(cipher) == len(payload)           # nothing added to the payload frame
        assert HEADER[:16] not in sealed and (size < 16 or payload[:16] not in cipher)
        verdict, header, opened = receiver.open(sealed, cipher)
        assert (verdict, header, opened) == ("ok", HEADER, payload)
        # The same message sealed again looks nothing like the first time.
        again = sender.seal(HEADER, payload)
        # (A ciphertext under 16 bytes may repeat by chance: 1 byte 1 time in 256.)
        assert again[0] != sealed and (size < 16 or again[1] != cipher)
        assert receiver.open(*again)[0] == "ok"


def test_a_changed_message_is_rejected_and_the_original_still_passes():
    client, server = _link()
    sealed, cipher = client.seal(HEADER, b"p" * 1000)
    # counter | payload tag | sealed header | header tag
    changes = [(i, None) for i in (0, 7, 8, 8 + 20, len(sealed) - 40, len(sealed) - 1)]
    changes += [(None, i) for i in (0, 500, 999)]
    for in_sealed, in_cipher in changes:
        s, c = bytearray(sealed), bytearray(cipher)
        if in_sealed is not None:
            s[in_sealed] ^= 0x01
        else:
            c[in_cipher] ^= 0x80
        assert server.open(bytes(s), bytes(c))[0] == "forged", (in_sealed, in_cipher)
    assert server.open(sealed, cipher[:-1])[0] == "forged"           # truncated
    assert server.open(sealed, cipher + b"\0")[0] == "forged"        # extended
    assert server.open(sealed[:-1], cipher)[0] == "forged"
    # None of that moved the receiver's counter: the real message passes.
    assert server.open(sealed, cipher)[0] == "ok"
    # A message reflected back to its sender, or moved to another link of the
    # same job, does not open either: each link and direction has its own key.
    assert client.open(sealed, cipher)[0] == "forged"
    other_client, other_server = _link()
    assert other_server.open(*client.seal(HEADER, b"p"))[0] == "forged"


@pytest.fixture
def cipher_threads():
    """Sets this process's BYTEPS_CIPHER_THREADS for a test, then back to automatic."""
    yield _core().set_cipher_threads
    _core().set_cipher_threads(0)


def test_a_cipher_thread_count_out_of_range_is_refused(monkeypatch):
    for value in ("-1", "17", "two"):
        monkeypatch.setenv("BYTEPS_CIPHER_THREADS", value)
        with pytest.raises(ValueError, match=f"BYTEPS_CIPHER_THREADS='{value}' is not valid"):
            config.value("BYTEPS_CIPHER_THREADS")
    for value in ("0", "1", "16"):
        monkeypatch.setenv("BYTEPS_CIPHER_THREADS", value)
        assert config.value("BYTEPS_CIPHER_THREADS") == int(value)


def test_a_large_message_sealed_in_slices_opens_whole_and_any_change_is_rejected(
        cipher_threads):
    """With 4 cipher threads a 4 MiB payload is sealed as 4 slices, one tag
    each (in the header frame, covered by the header's tag); a receiver
    opens it whatever its own thread count. A change in any slice, slices
    swapped with their tags, a tag dropped, or a replay is refused."""
    assert cipher_threads(4) == 4
    client, server = _link()
    payload = os.urandom(4 << 20)
    sealed, cipher = client.seal(HEADER, payload)
    one_slice = len(client.seal(HEADER, b"x" * 1000)[0])
    tag = (len(sealed) - one_slice) // 3
    assert tag >= 16 and len(sealed) == one_slice + 3 * tag      # four slice tags
    assert cipher_threads(1) == 1                                  # the receiver: one thread
    assert server.open(sealed, cipher) == ("ok", HEADER, payload)
    assert server.open(sealed, cipher)[0] == "replayed"
    cipher_threads(4)
    sealed, cipher = client.seal(HEADER, payload)
    for at in (0, (1 << 20) + 5, (3 << 20) + 17, len(cipher) - 1):  # each slice
        c = bytearray(cipher)
        c[at] ^= 0x04
        assert server.open(sealed, bytes(c))[0] == "forged", at
    quarter = len(cipher) // 4
    swapped_cipher = cipher[quarter:2 * quarter] + cipher[:quarter] + cipher[2 * quarter:]
    s = bytearray(sealed)
    s[8:8 + tag], s[8 + tag:8 + 2 * tag] = sealed[8 + tag:8 + 2 * tag], sealed[8:8 + tag]
    assert server.open(bytes(s), swapped_cipher)[0] == "forged"
    assert server.open(sealed[:8] + sealed[8 + tag:], cipher)[0] == "forged"  # a tag dropped
    # Nothing of that moved the counter: the real message still opens.
    assert server.open(sealed, cipher) == ("ok", HEADER, payload)


def test_a_replayed_or_reordered_message_is_rejected():
    client, server = _link()
    m1, m2, m3 = (client.seal(HEADER, bytes([i]) * 64) for i in range(3))
    assert server.open(*m1)[0] == "ok"
    assert server.open(*m1)[0] == "replayed"       # the same message again
    assert server.open(*m3)[0] == "ok"
    assert server.open(*m2)[0] == "replayed"       # an older one after a newer: reordered
    assert server.open(*m3)[0] == "replayed"
    assert server.open(*client.seal(HEADER, b"next"))[2] == b"next"


def test_the_handshake_admits_only_holders_of_the_token():
    core = _core()
    key, other = os.urandom(32), os.urandom(32)
    client = core.LinkEnd(other)
    with pytest.raises(ValueError, match="MAC does not verify"):
        core.LinkEnd(key).answer(client.hello())          # a hello made with another token
    client = core.LinkEnd(key)
    hello = bytearray(client.hello())
    hello[20] ^= 1                                          # its X25519 key changed on the way
    with pytest.raises(ValueError, match="MAC does not verify"):
        core.LinkEnd(key).answer(bytes(hello))
    answer = bytearray(core.LinkEnd(key).answer(client.hello()))
    answer[20] ^= 1
    with pytest.raises(ValueError, match="MAC does not verify"):
        client.finish(bytes(answer))
    # An answer made with another token: the connecting end refuses it too.
    client = core.LinkEnd(key)
    with pytest.raises(ValueError, match="MAC does not verify"):
        client.finish(core.LinkEnd(other).answer(core.LinkEnd(other).hello()))


@pytest.mark.parametrize("old", [1, 2, 3])
def test_a_hello_of_an_earlier_release_is_refused_by_name(old):
    """Sealed links spoke handshake version 1 before sliced payloads, 2
    before payloads shared by several links and 3 before the slow token
    derivation and the public gate; such a node would read those messages
    as forged (or hold other keys), so the handshake refuses it, naming
    another release."""
    key = os.urandom(32)
    hello = bytearray(_core().LinkEnd(key).hello())
    assert hello[:4] == b"BPSK" and hello[4] == 4
    hello[4] = old
    with pytest.raises(ValueError, match=rf"handshake version {old} \(this node speaks 4\): "
                                         r"a bps_tf of another release"):
        _core().LinkEnd(key).answer(bytes(hello))


@pytest.mark.parametrize("size", [1, 4096, 4 << 20])
def test_a_payload_sealed_once_for_several_links_opens_on_each_and_nowhere_else(
        size, cipher_threads):
    """A server's sum goes to every worker: it is encrypted once (under a
    fresh key) and each link carries that key in its own sealed header. Every
    link opens it to the same bytes; its header stays link-sealed (replay,
    reorder and a message moved to another link are refused); the shared
    ciphertext changed anywhere, or joined to another message's header, is
    refused; the same payload shared again is encrypted under a new key."""
    cipher_threads(4)
    payload = os.urandom(size)
    links = [_link() for _ in range(3)]
    servers = [s for _, s in links]
    sent = _core().LinkEnd.seal_shared(servers, HEADER, payload)
    assert len({c for _, c in sent}) == 1                       # encrypted once
    assert len({s for s, _ in sent}) == 3                       # a header per link
    assert size < 16 or payload[:16] not in sent[0][1]
    (c0, _), (c1, _), (c2, _) = links
    assert c1.open(*sent[0])[0] == "forged"                     # another link's message
    assert c0.open(sent[0][0], sent[0][1][:-1] + bytes([sent[0][1][-1] ^ 1]))[0] == "forged"
    for (client, _), msg in zip(links, sent):
        assert client.open(*msg) == ("ok", HEADER, payload)
        assert client.open(*msg)[0] == "replayed"
    # A second payload shared on the same links: a new key, so its
    # ciphertext differs even for the same bytes, and the old ciphertext
    # does not open under the new header.
    again = _core().LinkEnd.seal_shared(servers, HEADER, payload)
    if size >= 16:  # one byte under two keys is the same byte 1 time in 256
        assert again[0][1] != sent[0][1]
        assert c0.open(again[0][0], sent[0][1])[0] == "forged"
    # That did not move the counter: the real message opens; link-sealed
    # and shared messages interleave on one link.
    assert c0.open(*again[0]) == ("ok", HEADER, payload)
    assert c0.open(*servers[0].seal(HEADER, b"single")) == ("ok", HEADER, b"single")
    shared_flag = bytearray(servers[0].seal(HEADER, payload)[0])
    shared_flag[7] ^= 0x80                                       # claims the shared form
    assert c0.open(bytes(shared_flag), sent[0][1])[0] == "forged"


def test_a_recorded_handshake_replayed_later_opens_nothing():
    """Someone who recorded a link (its hello and sealed messages) replays
    them: the listening end answers with fresh keys, so the recorded
    messages do not open, and the recording taught nothing about the keys."""
    core = _core()
    key = os.urandom(32)
    client, server = core.LinkEnd(key), core.LinkEnd(key)
    hello = client.hello()
    answer = server.answer(hello)
    client.finish(answer)
    recorded = client.seal(HEADER, b"secret gradient")
    assert server.open(*recorded)[0] == "ok"
    replaying = core.LinkEnd(key)
    assert replaying.answer(hello) != answer              # fresh X25519 key each time
    assert replaying.open(*recorded)[0] == "forged"


class SealedPeer:
    """A peer of the job on a pyzmq DEALER, with what a process holding the
    token derives (the gate credential, the link key): it does the link's
    handshake and seals its own messages, to send them changed, again or
    out of order."""

    def __init__(self, port, token, link_key=None):
        import zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.plain_username = b"bps_tf"
        self.sock.plain_password = security.gate_password(token, security.ENCRYPTION_ON)
        self.end = _core().LinkEnd(link_key or security.derive(token, "link_key"))
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.sock.send(self.end.hello())

    def finish(self, timeout_ms=10000):
        assert self.sock.poll(timeout_ms), "no answer to the hello"
        self.end.finish(self.sock.recv_multipart()[0])
        return self

    def alert(self, timeout_ms=10000):
        """The text of the ERROR the listening end sealed to this peer."""
        assert self.sock.poll(timeout_ms), "no alert"
        verdict, header, text = self.end.open(*self.sock.recv_multipart())
        assert verdict == "ok" and struct.unpack("<IHH", header[:8])[2] == 13, verdict
        return text.decode()

    def close(self):
        self.sock.close()
        self.ctx.term()


# Authentic but not of the protocol (magic 0): a server drops it after
# opening it, so sending it confirms a link and changes nothing else.
HARMLESS = b"\0" * 4 + HEADER[4:]


def _attack_with_sealed_messages(port, token):
    """Each attack on a fresh link: the server answers every one with an
    alert naming what it rejected, and closes that link."""
    alerts = {}
    peer = SealedPeer(port, token).finish()
    m1 = peer.end.seal(HARMLESS, b"a" * 100)
    peer.sock.send_multipart(list(m1))
    peer.sock.send_multipart(list(m1))                     # replayed
    alerts["replayed"] = peer.alert()
    peer.close()
    peer = SealedPeer(port, token).finish()
    m1, m2 = peer.end.seal(HARMLESS, b"a"), peer.end.seal(HARMLESS, b"b")
    peer.sock.send_multipart(list(m2))
    peer.sock.send_multipart(list(m1))                     # reordered
    alerts["reordered"] = peer.alert()
    peer.close()
    peer = SealedPeer(port, token).finish()
    peer.sock.send_multipart(list(peer.end.seal(HARMLESS, b"a" * 100)))
    sealed, cipher = peer.end.seal(HARMLESS, b"a" * 100)
    peer.sock.send_multipart([sealed, cipher[:50] + b"b" + cipher[51:]])   # changed
    alerts["changed"] = peer.alert()
    peer.close()
    # Past the gate (a public label: any PLAIN hello passes) without the link
    # key: the hello is refused in clear, naming the cause, and anything sent
    # in its place is dropped unopened.
    peer = SealedPeer(port, token, link_key=os.urandom(32))
    assert peer.sock.poll(10000), "a peer without the link key was not told why"
    refusal = peer.sock.recv_multipart()
    assert len(refusal) == 1 and refusal[0][:4] == b"BPSR", refusal
    alerts["no link key"] = refusal[0][4:].decode()
    peer.sock.send_multipart([os.urandom(136), os.urandom(100)])
    assert not peer.sock.poll(1000), "a peer without the link key got an answer"
    peer.close()
    return alerts


def test_sealed_messages_changed_replayed_or_reordered_are_rejected(tmp_path):
    """A process holding the token, on a link of its own to the scheduler's
    server, sends a message again, two out of order and one changed: the
    server rejects each with an alert the peer can read, logs it and closes
    that link; a peer without the link key gets no answer. The job's own
    workers go on with exact sums."""
    release = tmp_path / "attack_done"
    env = {"BYTEPS_ENCRYPTION": "1", "BYTEPS_PARTITION_BYTES": str(64 * 1024),
           "BYTEPS_LOG_LEVEL": "WARNING", "ROBUST_WAIT_FOR_FILE": str(release)}
    with ManualCluster(2, 1, [WORKER, "exact", str(tmp_path), "100"], env=env) as c:
        deadline = time.time() + 60
        while not all(os.path.exists(tmp_path / f"joined{r}") for r in range(2)):
            assert time.time() < deadline, c.log("server0")
            time.sleep(0.05)
        alerts = _attack_with_sealed_messages(c.port, c.base["BYTEPS_JOB_TOKEN"])
        release.touch()
        assert c.wait_all(c.workers, timeout=120)
        assert [w.returncode for w in c.workers] == [0, 0], c.log("worker0") + c.log("worker1")
        for r in range(2):
            with open(tmp_path / f"rank{r}.json") as f:
                assert json.load(f)["bad"] == []
        assert c.wait_all(c.servers, timeout=20)
        log = c.log("server0")
    refused = alerts.pop("no link key")
    assert "refused this node's handshake: its MAC does not verify: it holds another " \
           "BYTEPS_JOB_TOKEN" in refused, refused
    for kind, text in alerts.items():
        assert "rejected a message of this node" in text, (kind, text)
    assert "came again or out of order" in alerts["replayed"]
    assert "came again or out of order" in alerts["reordered"]
    assert "failed authentication" in alerts["changed"]
    assert "rejected a message from a peer" in log, log
    assert "rejected 3 sealed messages" in log, log


class ZmtpAttacker(TapProxy):
    """A relay on the path (like TapProxy) that reads ZeroMQ's framing
    (ZMTP 3: a 64-byte greeting, then frames of flags, size and body) of the
    bytes going one way (`direction`: pushes "to server", replies "to worker"),
    and does `attack` to the first message that carries a large frame:
    "changed" flips one bit of it, "replayed" sends it twice, "reordered"
    holds it back until the next one has gone."""

    def __init__(self, listen, target, attack, direction="to server"):
        self.attack, self.direction, self.done, self.held = attack, direction, False, None
        self.shared_form = None  # of the attacked message (a sealed link's form bit)
        super().__init__(listen, target)

    def _pump(self, src, dst, record):
        if not any(r is record for d, r in self.captured if d == self.direction):
            return super()._pump(src, dst, record)
        buf, frames, greeting = bytearray(), [], 64
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                buf += data
                if greeting:  # passed on as it comes: each end waits for parts of the other's
                    n = min(greeting, len(buf))
                    dst.sendall(bytes(buf[:n]))
                    del buf[:n]
                    greeting -= n
                    if greeting:
                        continue
                while True:
                    frame = self._next_frame(buf)
                    if frame is None:
                        break
                    flags, raw, body_at = frame
                    if flags & 0x04:                  # a command (the PLAIN handshake)
                        dst.sendall(raw)
                        continue
                    frames.append((raw, body_at))
                    if not flags & 0x01:              # the message's last frame
                        self._message(dst, frames)
                        frames = []
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    @staticmethod
    def _next_frame(buf):
        if len(buf) < 2:
            return None
        flags = buf[0]
        head = 9 if flags & 0x02 else 2
        if len(buf) < head:
            return None
        size = struct.unpack(">Q", bytes(buf[1:9]))[0] if flags & 0x02 else buf[1]
        if len(buf) < head + size:
            return None
        raw = bytes(buf[:head + size])
        del buf[:head + size]
        return flags, raw, head

    def _message(self, dst, frames):
        out = b"".join(raw for raw, _ in frames)
        with self.lock:
            # Reordered: the next message on the same connection first (a
            # message of another worker's connection would carry the held
            # one onto a link with other keys: a changed message, not a
            # reordered one).
            if self.held is not None and self.held[0] is dst:
                dst.sendall(out)
                dst.sendall(self.held[1])
                self.held = None
                return
            target = not self.done and len(frames) == 2 and len(frames[1][0]) > 32 * 1024
            if target:
                self.done = True
        if not target:
            dst.sendall(out)
            return
        # The sealed header's counter (8 bytes, little-endian) has its top
        # bit set when the payload was encrypted once for several links.
        head, head_at = frames[0]
        self.shared_form = len(head) > head_at + 8 and bool(head[head_at + 7] & 0x80)
        if self.attack == "changed":
            raw, at = frames[1]
            flipped = bytearray(raw)
            flipped[at + 1000] ^= 0x01
            dst.sendall(frames[0][0] + bytes(flipped))
        elif self.attack == "replayed":
            dst.sendall(out + out)
        else:
            with self.lock:
                self.held = (dst, out)


def _job_through_attacker(tmp_path, attack, direction="to server", env=None):
    """A job of 2 workers and 1 server over TCP with sealed links, ROUNDS
    push_pulls of a pattern tensor in 64 KiB partitions, its workers reaching
    the server through a ZmtpAttacker doing `attack` in `direction`. Returns
    (the relay, the workers' exit codes, the logs)."""
    relay = []

    def start_relay(port):
        relay.append(ZmtpAttacker(("127.0.0.2", port), ("127.0.0.1", port), attack,
                                  direction=direction))
        return {"DMLC_PS_ROOT_URI": "127.0.0.2"}

    env = {"BYTEPS_ENCRYPTION": "1", "PATTERN_VALUE": str(PATTERN_VALUE),
           "BYTEPS_ENABLE_IPC": "0", "BYTEPS_PARTITION_BYTES": str(64 * 1024),
           "BYTEPS_TIMEOUT": "3", "BYTEPS_HEARTBEAT_INTERVAL": "0.5",
           "BYTEPS_FATAL_EXIT_GRACE": "2", **(env or {})}
    try:
        with ManualCluster(2, 1, [WORKER, "pattern", str(tmp_path), str(ROUNDS)], env=env,
                           server_env={"DMLC_NODE_HOST": "127.0.0.2"},
                           before_workers=start_relay) as c:
            assert c.wait_all(c.workers + c.servers, timeout=120)
            codes = [p.returncode for p in c.workers]
            logs = {name: c.log(name) for name in ("worker0", "worker1", "server0")}
    finally:
        for r in relay:
            r.close()
    return relay[0], codes, logs


def _assert_no_wrong_sum(tmp_path):
    """A worker that finished its rounds found every sum exact."""
    for r in range(2):
        if os.path.exists(tmp_path / f"rank{r}.json"):
            with open(tmp_path / f"rank{r}.json") as f:
                assert json.load(f)["bad"] == []


@pytest.mark.parametrize("attack", ["changed", "replayed", "reordered"])
def test_a_push_changed_replayed_or_reordered_on_the_wire_stops_the_job_with_why(
        tmp_path, attack):
    """An attacker on the path between the workers and the server changes,
    repeats or reorders one push of a real job. The server rejects that
    message (nothing is summed from it), tells the worker, and the worker
    stops with what happened instead of computing on: every process exits
    non-zero, no push_pull returns a wrong sum."""
    relay, codes, logs = _job_through_attacker(tmp_path, attack)
    assert relay.done, "the relay saw no push"
    assert codes != [0, 0], logs
    words = "came again or out of order" if attack != "changed" else "failed authentication"
    told = [n for n in ("worker0", "worker1")
            if "rejected a message of this node" in logs[n] and words in logs[n]]
    assert told, logs
    assert "rejected a message from a peer" in logs["server0"], logs["server0"]
    _assert_no_wrong_sum(tmp_path)


@pytest.mark.parametrize("fusion", ["262144", "0"], ids=["default", "no-fusion"])
def test_a_reply_changed_on_the_wire_stops_the_job_with_why(tmp_path, fusion):
    """The same attack on a server's reply, which a worker decrypts straight
    into its output tensor: the reply fails authentication, the worker stops
    saying so, and no push_pull returns what the decryption left there. With
    fusion off every reply is a sum sent alone to each of both workers, so
    encrypted once for both (link_cipher.h SharedSeal): the changed one is
    refused the same way. (With fusion on, a reply goes fused or alone as
    the sums happen to be ready together or not.)"""
    relay, codes, logs = _job_through_attacker(tmp_path, "changed", direction="to worker",
                                               env={"BYTEPS_FUSION_THRESHOLD": fusion})
    assert relay.done, "the relay saw no reply"
    if fusion == "0":
        assert relay.shared_form, "the changed reply was not one encrypted for both workers"
    assert codes != [0, 0], logs
    assert any("failed authentication" in logs[n] for n in ("worker0", "worker1")), logs
    _assert_no_wrong_sum(tmp_path)


@pytest.mark.parametrize("job, newcomer, theirs, mine", [
    ("1", "0", "BYTEPS_ENCRYPTION=1", "BYTEPS_ENCRYPTION=0"),
    ("0", "1", "BYTEPS_ENCRYPTION=0", "BYTEPS_ENCRYPTION=1"),
    ("1", "curve", None, "BYTEPS_ENCRYPTION=curve"),
], ids=["off-joins-on", "on-joins-off", "curve-joins-sealed"])
def test_nodes_that_disagree_on_encryption_refuse_each_other_with_why(tmp_path, job, newcomer,
                                                                       theirs, mine):
    """Encryption is agreed by every node or refused: a worker whose
    BYTEPS_ENCRYPTION differs from the scheduler's stops at once, naming both
    settings (with the token, both ends pass libzmq's gate; the first
    record each sends tells the other what it uses)."""
    # Worker 0 has the job's settings; worker 1 comes with its own.
    env = {"BYTEPS_ENCRYPTION": job, "BYTEPS_RENDEZVOUS_TIMEOUT": "60",
           "BYTEPS_ENABLE_IPC": "0", "DMLC_NUM_WORKER": "2"}
    with ManualCluster(1, 1, [WORKER, "idle", str(tmp_path)], env=env) as c:
        c.base["BYTEPS_ENCRYPTION"] = newcomer
        started = time.time()
        worker = c._start("newcomer", [sys.executable, WORKER, "loop", str(tmp_path)],
                          {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "1",
                           "DMLC_PS_ROOT_PORT": str(c.port)})
        c.workers.append(worker)
        assert c.wait_all([worker], timeout=30)
        assert time.time() - started < 20 and worker.returncode != 0
        log = c.log("newcomer")
        assert "could not meet the cluster: the connection to tcp://127.0.0.1:" in log, log
        assert "was refused" in log and mine in log, log
        assert theirs is None or theirs in log, log
        assert "set BYTEPS_JOB_TOKEN and BYTEPS_ENCRYPTION the same on every node" in log, log
        assert "refused a connection on" in c.log("server0")


def test_the_loaded_libzmq_is_known_to_run_curve_on_libsodium():
    """BYTEPS_ENCRYPTION=curve warns when libzmq encrypts with its bundled
    TweetNaCl (core/transport/curve_check.h); pyzmq's wheel links libsodium,
    so no probe runs and no warning is due."""
    backend = _core().curve_backend(True)
    assert backend["libzmq"] and os.path.exists(backend["libzmq"]), backend
    if "pyzmq.libs" in backend["libzmq"]:
        assert backend["links_libsodium"] and not backend["measured"], backend
    assert not backend["slow"], backend


def test_libsodium_is_called_in_libsodium_not_in_a_tweetnacl_libzmq(tmp_path):
    """A libzmq built with TweetNaCl exports sodium_init, crypto_verify_32 and
    more under libsodium's names. Loaded first, a process-wide lookup would
    bind the core to them: here a stand-in whose crypto_verify_32 accepts
    everything and whose sodium_init fails. The core looks its functions up
    in libsodium itself, so a hello made with another token is still refused."""
    import shutil
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("g++")
    # The build itself needs a C/C++ compiler, so one is always there.
    assert compiler is not None, "no C compiler for the stand-in library"
    src = tmp_path / "tweetnacl_names.c"
    src.write_text("int sodium_init(void) { return -1; }\n"
                   "int crypto_verify_32(const unsigned char* x, const unsigned char* y)"
                   " { return 0; }\n")
    lib = tmp_path / "libtweetnacl_names.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    script = f"""
import ctypes, os
ctypes.CDLL({str(lib)!r}, mode=ctypes.RTLD_GLOBAL)
from bps_tf.runtime import basics
core = basics.core()
print(core.sodium_describe())
try:
    core.LinkEnd(os.urandom(32)).answer(core.LinkEnd(os.urandom(32)).hello())
    print("accepted")
except ValueError as exc:
    print("refused:", exc)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=tempfile.gettempdir())
    assert proc.returncode == 0, proc.stderr[-3000:]
    described, outcome = proc.stdout.splitlines()
    assert described.startswith("libsodium 1.") and "libsodium" in described.split("(")[1]
    assert outcome.startswith("refused:") and "MAC does not verify" in outcome
