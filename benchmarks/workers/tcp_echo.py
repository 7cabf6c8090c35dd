"""The raw-TCP bound of the parameter-server data movement.

`tcp_echo.py server HOST PORT_FILE`: echoes every byte back on each
connection (a receiving thread and a sending thread per connection, so both
directions stream at once, as a bps_tf server's do).

`tcp_echo.py client SPEC.json RANK`: for each case of the spec, sends the
case's bytes split evenly over the servers (spec["servers"]) and receives
them back, all connections at once. A barrier (files in
spec["barrier_dir"]) aligns the spec["clients"] clients before each
repetition, so they compete for the links and CPUs as bps_tf workers do. Writes OUT_DIR/echo<rank>.json.
"""
import json
import os
import queue
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.common import file_barrier_fn

CHUNK = 4 << 20      # large recv_into buffers keep Python off the hot path
BUFFERS = 8          # per connection: bounds memory and acts as flow control


def serve_connection(conn):
    free = queue.Queue()
    for _ in range(BUFFERS):
        free.put(bytearray(CHUNK))
    full = queue.Queue()

    def receive():
        try:
            while True:
                buf = free.get()
                n = conn.recv_into(buf)
                full.put((buf, n))
                if n == 0:
                    return
        except OSError:
            full.put((None, 0))

    def send():
        try:
            while True:
                buf, n = full.get()
                if n == 0:
                    return
                conn.sendall(memoryview(buf)[:n])
                free.put(buf)
        except OSError:
            return
        finally:
            conn.close()

    threading.Thread(target=receive, daemon=True).start()
    threading.Thread(target=send, daemon=True).start()


def server(host, port_file):
    listener = socket.create_server((host, 0), backlog=64)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(listener.getsockname()[1]))
    os.replace(port_file + ".tmp", port_file)
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        serve_connection(conn)


def send_all(conn, view):
    conn.sendall(view)


def recv_exactly(conn, view):
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("echo server closed the connection")
        got += n


def client(spec_path, rank):
    spec = json.load(open(spec_path))
    conns = []
    for address in spec["servers"]:
        host, port = address.rsplit(":", 1)
        c = socket.create_connection((host, int(port)))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns.append(c)
    barrier = file_barrier_fn(spec["barrier_dir"], rank, spec["clients"])
    pool = ThreadPoolExecutor(2 * len(conns))
    results = []
    for case in spec["cases"]:
        total = case["bytes"]
        share = -(-total // len(conns))
        src = bytearray(share * len(conns))
        dst = bytearray(len(src))
        starts, ends = [], []
        for k in range(case["warmup"] + case["reps"]):
            barrier()
            t0 = time.perf_counter()
            jobs = []
            for i, c in enumerate(conns):
                part = slice(i * share, (i + 1) * share)
                jobs.append(pool.submit(send_all, c, memoryview(src)[part]))
                jobs.append(pool.submit(recv_exactly, c, memoryview(dst)[part]))
            for j in jobs:
                j.result()
            t1 = time.perf_counter()
            if k >= case["warmup"]:
                starts.append(t0)
                ends.append(t1)
        results.append({"label": case["label"], "starts": starts, "ends": ends,
                        "bytes": len(src)})
    out = os.path.join(spec["out_dir"], f"echo{rank}.json")
    with open(out + ".tmp", "w") as f:
        json.dump({"rank": rank, "cases": results}, f)
    os.replace(out + ".tmp", out)
    pool.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(sys.argv[2], sys.argv[3])
    else:
        client(sys.argv[2], int(sys.argv[3]))
