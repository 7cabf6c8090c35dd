"""A worker that leaves an elastic job while an operation of its last epoch
is still pending, for tests/test_elastic_launch.py (numpy, no TensorFlow).

Three workers (launch ids 0, 1, 2). Worker 2 asks to leave at the next
commit (as SIGTERM does); once every worker has heard of it, all make one
agreement push_pull (a commit's), then 0 and 1 restart their membership
(an agreed change: the scheduler fails no operation of theirs) and sum once
in the new epoch (bpslaunch's replacement for worker 2 may join it).
Worker 2 instead waits for one more push_pull of
the old epoch that nobody else makes: it must fail at once with the
membership change (the servers drop what the old epoch still had queued for
it, so nothing else would ever end it), not wait until WAIT_S. Each worker
writes OUT/w<launch id>.json.
"""
import json
import os
import sys
import time

import numpy as np

from bps_tf.runtime import basics, elastic_core

OUT = sys.argv[1]
WAIT_S = float(sys.argv[2])
LAUNCH = os.environ["BYTEPS_LAUNCH_ID"]


def push_pull(name, value, wait_s=60.0):
    out = np.empty(1, np.float32)
    basics.core().push_pull_async(name, np.full(1, value, np.float32), out, 0).wait(wait_s)
    return float(out[0])


def write(result):
    with open(os.path.join(OUT, f"w{LAUNCH}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(OUT, f"w{LAUNCH}.json.tmp"), os.path.join(OUT, f"w{LAUNCH}.json"))


basics.join()
if LAUNCH not in ("0", "1", "2"):
    # bpslaunch's replacement for the leaver: it joins at the change and
    # makes the new epoch's calls.
    write({"launch": LAUNCH, "size_after": basics.size(),
           "after": push_pull("after", basics.rank() + 1.0)})
    basics.shutdown()
    sys.exit(0)
result = {"launch": LAUNCH, "first": push_pull("first", basics.rank() + 1.0)}
if LAUNCH == "2":
    result["asked"] = bool(basics.core().elastic_request_leave())
since = time.time()
while not elastic_core.host_updates():   # the scheduler's notice: a worker leaves
    if time.time() - since > 60:
        raise SystemExit(f"worker {LAUNCH}: no host update within 60 s")
    time.sleep(0.05)
if LAUNCH != "2":
    result["agreed"] = push_pull("agree", 1.0)
    elastic_core.restart()
    result["size_after"] = basics.size()
    result["after"] = push_pull("after", basics.rank() + 1.0)
    write(result)
    basics.shutdown()
    sys.exit(0)
started = time.time()
try:
    # Its reply to the agreement may be among what the servers drop: then
    # the change ends that wait instead.
    result["agreed"] = push_pull("agree", 1.0, WAIT_S)
    started = time.time()
    result["pending"] = push_pull("only_the_leaver", 1.0, WAIT_S)
except Exception as exc:  # noqa: BLE001 - what ended the wait is the result
    result["pending_error"] = str(exc)
result["pending_s"] = time.time() - started
result["leaving"] = elastic_core.leaving()
write(result)
elastic_core.leave()   # exit 0
