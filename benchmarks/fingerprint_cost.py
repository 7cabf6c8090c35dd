"""The replica fingerprint's cost against a step of model.fit: 2 workers +
1 server on loopback, a 669,706-parameter MLP (784-512-512-10, Adam), the
check at the default interval (BYTEPS_FINGERPRINT_STEPS=100) as a share of
100 steps. Baseline in the same run: the same check taken eagerly, a few
ops per variable (how fit took it before it traced one function per model).

    python benchmarks/fingerprint_cost.py [--rounds 3] [--batch 64] [--steps 40]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

INTERVAL = 100       # BYTEPS_FINGERPRINT_STEPS' default
TARGET = 0.01        # the check's share of the steps between two checks


def run(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bps_fingerprint_") as tmp, \
            common.processes() as procs:
        spec = common.write_spec(Path(tmp), {"batch": args.batch, "steps": args.steps,
                                             "epochs": args.epochs, "checks": args.checks})
        argv = [common.PYTHON, str(common.WORKERS_DIR / "fingerprint_cost.py"), str(spec), tmp]
        common.run_bps_job(procs, argv, num_workers=2, num_servers=1, timeout=args.timeout)
        results = common.read_results(Path(tmp), 2)
    # The slower worker sets the pace of a collective step or check.
    return {k: max(r[k] for r in results) for k in ("step_s", "check_s", "check_eager_s")} | \
        {"parameters": results[0]["parameters"], "variables": results[0]["variables"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--checks", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out-dir")
    args = ap.parse_args()
    rounds = []
    for r in range(args.rounds):
        print(f"[round {r + 1}/{args.rounds}] ...", flush=True)
        rounds.append(run(args))
    med = {k: common.median(x[k] for x in rounds) for k in ("step_s", "check_s", "check_eager_s")}
    share = lambda check: check / (INTERVAL * med["step_s"])  # noqa: E731
    rows = [["step (fingerprint off)", f"{1e3 * med['step_s']:.1f}", "", ""],
            ["one check, traced (fit's)", f"{1e3 * med['check_s']:.1f}",
             f"{100 * share(med['check_s']):.2f} %", "pass" if share(med["check_s"]) <= TARGET
             else "FAIL"],
            ["one check, eager (before)", f"{1e3 * med['check_eager_s']:.1f}",
             f"{100 * share(med['check_eager_s']):.2f} %", ""]]
    common.print_table(f"replica fingerprint of a {rounds[0]['parameters']:,}-parameter MLP "
                       f"({rounds[0]['variables']} variables), 2 workers + 1 server, loopback, "
                       f"median of {args.rounds} rounds",
                       ["what", "ms", f"share of {INTERVAL} steps", f"<= {100 * TARGET:g} %"],
                       rows)
    common.write_json("fingerprint_cost", {"args": vars(args), "rounds": rounds, "median": med,
                                           "share_at_default": share(med["check_s"]),
                                           "eager_share_at_default": share(med["check_eager_s"]),
                                           "target": TARGET}, args.out_dir)
    return 0


if __name__ == "__main__":
    common.run_main(main)
