"""A numpy worker for benchmarks/control_plane.py: the control plane's clock.

Usage: scale_worker.py SPEC.json. Records (time.time(), comparable across the
processes of one machine) when the process started, when its imports were
done, when bps_tf.init() began and returned, and the start and end of every
round: 16 tensors of 1 KiB and one of 1 MiB (the spec's "small" and
"big_elems" change them), every sum checked. After its
first round it touches DIR/first.<rank>; it then goes on with a round every
`interval_s` until DIR/stop exists. Elastic (BYTEPS_ELASTIC=1): a round that
fails because the workers changed restarts the membership and goes on; the
first round that completes after the change touches DIR/after.<rank>.
Every round also sums a stop vote, so all workers stop after the same one.
Writes DIR/worker<original rank>.json.
"""
import time

T_START = time.time()

import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402

import bps_tf  # noqa: E402
from bps_tf.runtime import basics, elastic_core  # noqa: E402

SMALL, SMALL_ELEMS, BIG_ELEMS = 16, 256, 262144   # 16 x 1 KiB + 1 MiB of float32


def one_round(core, wait_s, stop_vote, small=SMALL, big_elems=BIG_ELEMS):
    """One round; True when some worker saw the stop file (every worker gets
    the same sum, so all of them stop after the same round)."""
    rank, size = basics.rank(), basics.size()
    value = float(rank + 1)
    ins = [np.full(SMALL_ELEMS, value, np.float32) for _ in range(small)]
    ins.append(np.full(big_elems, value, np.float32))
    outs = [np.empty_like(a) for a in ins]
    names = [f"small{i}" for i in range(small)] + ["big"]
    vote, votes = np.array([1.0 if stop_vote else 0.0], np.float32), np.empty(1, np.float32)
    handles = [core.push_pull_async(n, a, o, 0, "") for n, a, o in zip(names, ins, outs)]
    handles.append(core.push_pull_async("stop_vote", vote, votes, 0, ""))
    for h in handles:
        h.wait(wait_s)
    expect = size * (size + 1) / 2
    for n, o in zip(names, outs):
        if not (o[0] == expect and o[-1] == expect and (o == expect).all()):
            raise SystemExit(f"worker {rank}: {n} summed to {o[0]}, expected {expect} "
                             f"({size} workers)")
    if not 0 <= votes[0] <= size:
        raise SystemExit(f"worker {rank}: the stop votes summed to {votes[0]} of {size} workers")
    return votes[0] > 0


def touch(directory, name):
    with open(os.path.join(directory, name), "w"):
        pass


def cpu():
    """CPU seconds of this process so far, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main():
    spec = json.load(open(sys.argv[1]))
    out_dir, interval, wait_s = spec["out_dir"], spec["interval_s"], spec.get("wait_s", 120.0)
    t_import, cpu_import = time.time(), cpu()
    bps_tf.init()
    t_init, cpu_init = time.time(), cpu()
    core, first_rank = basics.core(), basics.rank()
    rounds, changes = [], []
    stop = os.path.join(out_dir, "stop")
    after_change = False
    while True:
        t0 = time.time()
        try:
            stopping = one_round(core, wait_s, os.path.exists(stop), spec.get("small", SMALL),
                                 spec.get("big_elems", BIG_ELEMS))
        except Exception as exc:   # noqa: BLE001 - a membership change, or a real failure
            if not (elastic_core.enabled() and elastic_core.changed()):
                raise
            t_seen, cpu_seen = time.time(), cpu()
            elastic_core.restart()
            core = basics.core()
            changes.append({"failed_round_start": t0, "seen": t_seen, "rejoined": time.time(),
                            "cpu_seen": cpu_seen, "cpu_rejoined": cpu(),
                            "size": basics.size(), "error": str(exc)[:200]})
            after_change = True
            continue
        t1 = time.time()
        rounds.append([t0, t1])
        if len(rounds) == 1:
            cpu_first = cpu()
            touch(out_dir, f"first.{first_rank}")
        if after_change:
            changes[-1]["next_sum"] = t1
            changes[-1]["cpu_next_sum"] = cpu()
            touch(out_dir, f"after.{first_rank}")
            after_change = False
        if stopping:
            break
        time.sleep(max(0.0, interval - (time.time() - t0)))
    # A last small sum before leaving: when it completes, every worker has had
    # every earlier sum, so none is left waiting on a hot server's queue of
    # 1 MiB replies when the first one shuts down (which fails what others
    # still wait for, docs/scaling.md).
    done, total = np.ones(1, np.float32), np.empty(1, np.float32)
    core.push_pull_async("goodbye", done, total, 0, "").wait(wait_s)
    result = {"rank": first_rank, "size": basics.size(), "start": T_START, "imported": t_import,
              "init_start": t_import, "init_end": t_init, "rounds": rounds, "changes": changes,
              "cpu_import": cpu_import, "cpu_init": cpu_init, "cpu_first": cpu_first}
    path = os.path.join(out_dir, f"worker{first_rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    basics.shutdown()


if __name__ == "__main__":
    main()
