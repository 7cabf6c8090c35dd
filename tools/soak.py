"""Long soak: 4 workers x 2 servers, N push_pulls of random sizes (0 bytes to
3 partitions) and dtypes; every sum checked; worker and server memory
sampled. The test suite runs a short version (tests/test_robustness.py).

    python tools/soak.py --rounds 10000
"""
import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from manual_cluster import ROOT, ManualCluster, rss_mb  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=10000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--partition-bytes", type=int, default=256 * 1024)
    args = ap.parse_args()
    out = tempfile.mkdtemp(prefix="bps_soak_")
    worker = os.path.join(ROOT, "tests", "workers", "robust_worker.py")
    start = time.time()
    env = {"BYTEPS_PARTITION_BYTES": str(args.partition_bytes)}
    server_rss = []
    with ManualCluster(args.workers, args.servers, [worker, "exact", out, str(args.rounds)],
                       env=env) as c:
        while any(w.poll() is None for w in c.workers):
            server_rss.append([rss_mb(s.pid) for s in c.servers if s.poll() is None])
            time.sleep(1.0)
        ok = all(w.returncode == 0 for w in c.workers) and c.wait_all(c.servers, 30)
    results = {}
    for r in range(args.workers):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            results[r] = json.load(f)
    bad = sum(len(v["bad"]) for v in results.values())
    print(f"{args.rounds} push_pulls x {args.workers} workers in {time.time() - start:.1f} s; "
          f"wrong sums: {bad}; clean exit: {ok}")
    print("rank  rss after warm-up MB  rss at end MB")
    for r, v in results.items():
        print(f"{r:4d}  {v['rss']['warm']:20.1f}  {v['rss']['end']:13.1f}")
    if server_rss:
        warm = server_rss[len(server_rss) // 5]
        print("server rss MB after warm-up:", [round(x, 1) for x in warm],
              "at end:", [round(x, 1) for x in server_rss[-1]])
    return 0 if ok and bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
