"""Worker for the robustness tests (numpy, no TensorFlow).

Usage: robust_worker.py MODE OUT_DIR [N]
  loop   push_pull until an error, then exit 3 with the error on stderr
  idle   join, then sleep (never calls push_pull again)
  stall  each worker push_pulls a name the other never uses
  leave  worker 1 shuts down at once; worker 0 records its push_pull errors
  exact  N rounds of random sizes/dtypes, all checked; writes rank<r>.json
  pattern  N rounds of a float32 tensor holding PATTERN_VALUE everywhere
         (a byte pattern a test looks for on the wire); writes rank<r>.json
"""
import json
import os
import random
import sys
import time

import numpy as np

import bps_tf  # noqa: E402
from bps_tf.runtime import basics

MODE, OUT = sys.argv[1], sys.argv[2]
N = int(sys.argv[3]) if len(sys.argv) > 3 else 0
DTYPES = ["float16", "float32", "float64", "int32", "int64"]


def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0


bps_tf.init()
core = basics.core()
rank, size = basics.rank(), basics.size()
open(os.path.join(OUT, f"joined{rank}"), "w").close()

if MODE == "loop":
    i = 0
    try:
        while True:
            a = np.full(100000, 1.0, np.float32)
            out = np.empty_like(a)
            core.push_pull_async(f"loop{i % 3}", a, out, 0, "").wait(120)
            i += 1
    except RuntimeError as exc:
        print(f"push_pull failed: {exc}", file=sys.stderr, flush=True)
        sys.exit(3)

if MODE == "leave":
    # Worker 1 leaves at once; worker 0's push_pull must fail, naming it,
    # instead of waiting for a partner that is gone.
    if rank == 1:
        basics.shutdown()
        sys.exit(0)
    start = time.time()
    errors = []
    for attempt in range(2):
        a = np.ones(10, np.float32)
        try:
            core.push_pull_async("lonely", a, np.empty_like(a), 0, "").wait(60)
            errors.append(None)
        except RuntimeError as exc:
            errors.append(str(exc))
    with open(os.path.join(OUT, "leave.json"), "w") as f:
        json.dump({"errors": errors, "seconds": time.time() - start}, f)
    sys.exit(0)

if MODE == "stall":
    # Each worker push_pulls a tensor the other never does: both wait at
    # the scheduler until the stall check reports, then stops, the job.
    name = "only_on_rank0" if rank == 0 else "only_on_rank1"
    # What the strategy tells the core: the variable behind each key, and
    # the Keras phase; the stall warnings must show them.
    core.set_tensor_label("only_on_rank0", "dense/kernel")
    basics.set_activity(f"fit, epoch {rank + 1}")
    a = np.ones(10, np.float32)
    try:
        core.push_pull_async(name, a, np.empty_like(a), 0, "").wait(N or 120)
        print("push_pull returned", file=sys.stderr, flush=True)
    except RuntimeError as exc:
        print(f"push_pull failed: {exc}", file=sys.stderr, flush=True)
        sys.exit(3)
    sys.exit(0)

if MODE == "skip_round":
    # Both workers use 'shared' once; then worker 1 calls it again and
    # worker 0 does not (a later round: sent at once, it waits at the server).
    a = np.ones(10, np.float32)
    core.push_pull_async("shared", a, np.empty_like(a), 0, "").wait(60)
    if rank == 0:
        time.sleep(N or 20)
        sys.exit(0)
    core.set_tensor_label("shared", "dense_1/bias")
    basics.set_activity("fit, epoch 4 of 10")
    try:
        core.push_pull_async("shared", a, np.empty_like(a), 0, "").wait(120)
        print("push_pull returned", file=sys.stderr, flush=True)
    except RuntimeError as exc:
        print(f"push_pull failed: {exc}", file=sys.stderr, flush=True)
        sys.exit(3)
    sys.exit(0)

if MODE == "pattern":
    value = np.float32(os.environ["PATTERN_VALUE"])
    bad = []
    for i in range(N):
        a = np.full(64 * 1024, value, np.float32)
        out = np.empty_like(a)
        core.push_pull_async("pattern", a, out, 0, "").wait(120)
        if not np.array_equal(out, np.full_like(a, value * size)):
            bad.append(i)
    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
        json.dump({"bad": bad, "stats": basics.stats()}, f)
    basics.shutdown()
    sys.exit(0)

if MODE == "idle":
    time.sleep(300)
    sys.exit(0)

if MODE == "exact":
    part = int(os.environ["BYTEPS_PARTITION_BYTES"])
    rng = random.Random(1234)  # same sequence on every worker
    # A fixed menu of random sizes (0 bytes to 3 partitions) per dtype, as a
    # training job has a fixed set of tensors: after warm-up no new keys
    # appear, so memory must stay flat.
    menu = {d: [0] + [rng.randint(1, (3 * part) // np.dtype(d).itemsize) for _ in range(15)]
            for d in DTYPES}
    bad, rss = [], {}
    for i in range(N):
        dname = rng.choice(DTYPES)
        dt = np.dtype(dname)
        slot = rng.randrange(len(menu[dname]))
        count = menu[dname][slot]
        name = f"soak/{dname}/{slot}"
        base = (np.arange(count) % 5).astype(dt)
        a = base + dt.type(rank + 1)
        out = np.empty_like(a)
        core.push_pull_async(name, a, out, rng.randint(-3, 3), "").wait(120)
        expect = base * dt.type(size) + dt.type(size * (size + 1) // 2)
        if out.tobytes() != expect.tobytes():
            bad.append(i)
        if i == N // 5:
            rss["warm"] = rss_mb()
            open(os.path.join(OUT, f"warm{rank}"), "w").close()
    rss["end"] = rss_mb()
    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
        json.dump({"bad": bad, "rss": rss, "stats": basics.stats()}, f)
    # A test that attacks the servers while the job runs asks the workers to
    # stay until it is done, so the servers cannot exit under its feet.
    release = os.environ.get("ROBUST_WAIT_FOR_FILE")
    if release:
        deadline = time.time() + 600
        while not os.path.exists(release):
            if time.time() > deadline:
                sys.exit(f"{release} never appeared")
            time.sleep(0.05)
    # Hold on until every worker is done, so the servers are measured with
    # all of the job's state still alive.
    a = np.zeros(1, np.float32)
    core.push_pull_async("soak/done", a, np.empty_like(a), 0, "").wait(120)
    basics.shutdown()
