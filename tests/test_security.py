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


@pytest.mark.parametrize("env, mode, keys", [
    # with a token, the local links' credential too (Unix sockets on one machine)
    ({"BYTEPS_JOB_TOKEN": "s3cr3t"}, "aead",
     {"plain_credential", "link_key", "local_credential"}),
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
