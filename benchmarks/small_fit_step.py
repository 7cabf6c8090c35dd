"""Step time of an unchanged model.fit under BytePSStrategy on a tiny model,
where a step is almost only the engine's latency: 6 small gradients and the
strategy's few scalar reductions, each a round trip through the servers.

Baseline in the same run: the same job with one worker (its push_pulls still
go through a server, but nobody waits for a peer). A wake-up lost by an I/O
thread shows here at once (every message waits out a 100 ms poll timeout;
docs/performance-history.md, "A lost wake-up: 100 ms per message on quiet
channels").

    python benchmarks/small_fit_step.py [--workers 2] [--servers 1] [--rounds 3]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def run(workers: int, servers: int, overlap: bool, args) -> float:
    with tempfile.TemporaryDirectory(prefix="bps_small_fit_") as tmp, common.processes() as procs:
        spec = common.write_spec(Path(tmp), {"batch": 32, "steps": 32, "epochs": args.epochs,
                                             "overlap": overlap})
        argv = [common.PYTHON, str(common.WORKERS_DIR / "small_fit.py"), str(spec), tmp]
        common.run_bps_job(procs, argv, num_workers=workers, num_servers=servers,
                           timeout=args.timeout)
        return max(r["step_s"] for r in common.read_results(Path(tmp), workers))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out-dir")
    args = ap.parse_args()
    cases = [("1 worker", 1, False), (f"{args.workers} workers", args.workers, False),
             (f"{args.workers} workers, overlap", args.workers, True)]
    times = {name: [] for name, _, _ in cases}
    for r in range(args.rounds):
        for name, workers, overlap in cases:
            print(f"[round {r + 1}/{args.rounds}] {name} ...", flush=True)
            times[name].append(run(workers, args.servers, overlap, args))
    base = common.median(times["1 worker"])
    rows = [[name, f"{1e3 * common.median(t):.2f}", " ".join(f"{1e3 * v:.2f}" for v in t),
             f"{common.median(t) / base:.2f}"] for name, t in times.items()]
    common.print_table(f"model.fit step of a tiny model, {args.servers} server(s), loopback "
                       f"(median of {args.rounds} rounds)",
                       ["run", "ms per step", "per round", "/ 1 worker"], rows)
    common.write_json("small_fit_step", {"args": vars(args), "step_s": times}, args.out_dir)
    return 0


if __name__ == "__main__":
    common.run_main(main)
