"""Push_pulls per second of small (4 KiB) tensors: the per-operation cost of the
engine, which dominates models with many small gradients (biases, norms).

    python benchmarks/small_tensors.py [--quick] [--in-flight 1,16,256] [--no-tf-op]

2 workers x 1 server on loopback. Each repetition enqueues K push_pulls of
distinct 4 KiB tensors at once and waits for all of them; push_pulls/s =
K / (median repetition time). Measured through the numpy API (no
TensorFlow) and through the TF op (K ops in one tf.function, all in flight).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.common import PYTHON, WORKERS_DIR, median  # noqa: E402


def make_cases(in_flight, tensor_bytes: int, quick: bool):
    cases = []
    for k in in_flight:
        # About the same number of push_pulls per case, whatever K.
        reps = max(20, (800 if quick else 4000) // k)
        cases.append({"label": f"k{k}", "in_flight": k, "warmup": 3, "reps": reps,
                      "tensors": [[f"t{i}", [tensor_bytes // 4], 0] for i in range(k)]})
    return cases


def run(cases, script: str, workers: int, servers: int):
    with common.processes() as procs:
        spec = common.write_spec(procs.log_dir, {"out_dir": str(procs.log_dir), "cases": cases})
        common.run_bps_job(procs, [PYTHON, str(WORKERS_DIR / script), str(spec)],
                           num_workers=workers, num_servers=servers, timeout=900)
        results = common.read_results(procs.log_dir, workers)
    out = {}
    for i, case in enumerate(cases):
        per_worker = [r["cases"][i] for r in results]
        if not all(c["correct"] for c in per_worker):
            raise common.JobFailed(f"wrong sums in case {case['label']}")
        durations = common.rep_durations(per_worker)
        out[case["label"]] = {"median_s": median(durations), "reps": len(durations),
                              "total_s": sum(durations)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--in-flight", default="1,16,256",
                    help="comma-separated numbers of push_pulls in flight at once")
    ap.add_argument("--bytes", default="4KiB", help="size of each tensor")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--no-tf-op", action="store_true", help="numpy API only")
    ap.add_argument("--out-dir")
    args = ap.parse_args(argv)

    in_flight = [int(k) for k in args.in_flight.split(",")]
    cases = make_cases(in_flight, common.parse_size(args.bytes), args.quick)
    paths = {"numpy": "bps_numpy.py"} if args.no_tf_op else \
        {"numpy": "bps_numpy.py", "TF op": "bps_tf_op.py"}
    measured = {}
    with common.stop_on_signals():
        for name, script in paths.items():
            print(f"{name} ...", flush=True)
            measured[name] = run(cases, script, args.workers, args.servers)

    rows = []
    for case in cases:
        k = case["in_flight"]
        row = {"in_flight": k}
        for name in paths:
            m = measured[name][case["label"]]
            row[name] = dict(m, push_pulls_per_s=k / m["median_s"],
                             latency_ms=m["median_s"] * 1e3)
        rows.append(row)
    headers = ["in flight"] + [f"{n} push_pulls/s" for n in paths] + \
        [f"{n} ms per batch" for n in paths]
    common.print_table(
        f"{args.bytes} push_pulls, {args.workers} workers x {args.servers} server on loopback",
        headers, [[r["in_flight"]] + [r[n]["push_pulls_per_s"] for n in paths] +
                  [r[n]["latency_ms"] for n in paths] for r in rows])
    common.write_json("small_tensors", {
        "workers": args.workers, "servers": args.servers, "tensor_bytes":
        common.parse_size(args.bytes), "rows": rows,
        "targets": {"push_pulls_per_s": ">= 5000"}}, args.out_dir)
    return 0


if __name__ == "__main__":
    common.run_main(main)
