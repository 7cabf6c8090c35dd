"""Push_pulls per second of small (4 KiB) tensors: the per-operation cost of the
engine, which dominates models with many small gradients (biases, norms).

    python benchmarks/small_tensors.py [--quick] [--in-flight 1,16,256] [--no-tf-op]
        [--encryption on|off|both|all] [--rounds R] [--compare-fusion] [--env NAME=VALUE]

2 workers x 1 server on loopback. Each repetition enqueues K push_pulls of
distinct 4 KiB tensors at once and waits for all of them; push_pulls/s =
K / (median repetition time). Measured through the numpy API (no
TensorFlow) and through the TF op (K ops in one tf.function, all in flight):
once with the K tensors passed as the function's arguments, once with them
read from variables inside it ("TF op in-graph", as a train step's gradients
are made in the step; 64 Python arguments alone cost a call ~0.8 ms).
The jobs run with a job token, so encrypted (sealed links, the default of
BYTEPS_ENCRYPTION=1) unless --encryption off;
--encryption both adds the numpy path and the in-graph TF op with
BYTEPS_ENCRYPTION=0 (the same rounds, so their ratios hold), and all also
the numpy path with ZeroMQ CURVE (BYTEPS_ENCRYPTION=curve). With
--rounds R every path runs R times, interleaved, and the median is reported.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.common import PYTHON, WORKERS_DIR, median  # noqa: E402

UNENCRYPTED = "numpy no-enc"
CURVE = "numpy curve"
IN_GRAPH = "TF op in-graph"
IN_GRAPH_CLEAR = "TF op in-graph no-enc"


def make_cases(in_flight, tensor_bytes: int, quick: bool, reps_override: int = 0):
    cases = []
    for k in in_flight:
        # About the same number of push_pulls per case, whatever K.
        reps = reps_override or max(20, (800 if quick else 4000) // k)
        cases.append({"label": f"k{k}", "in_flight": k, "warmup": 3, "reps": reps,
                      "tensors": [[f"t{i}", [tensor_bytes // 4], 0] for i in range(k)]})
    return cases


def run(cases, script: str, workers: int, servers: int, env=None):
    with common.processes() as procs:
        spec = common.write_spec(procs.log_dir, {"out_dir": str(procs.log_dir), "cases": cases})
        common.run_bps_job(procs, [PYTHON, str(WORKERS_DIR / script), str(spec)],
                           num_workers=workers, num_servers=servers, timeout=900, env=env)
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
    ap.add_argument("--reps", type=int, default=0,
                    help="timed repetitions per case (default about 4,000 push_pulls, 800 "
                         "with --quick): at 64 in flight --quick times 20 batches, ~60 ms, "
                         "which one scheduler hiccup on a loaded machine can move by 30 %%")
    ap.add_argument("--no-tf-op", action="store_true", help="numpy API only")
    ap.add_argument("--encryption", choices=("on", "off", "both", "all"), default="on",
                    help="BYTEPS_ENCRYPTION of the jobs; both: the numpy path and the "
                         "in-graph TF op once more without encryption; all: and the numpy "
                         "path once more with CURVE")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every path this many times, interleaved; report the median")
    ap.add_argument("--compare-fusion", action="store_true",
                    help="add the TF op with tensor fusion off (BYTEPS_FUSION_THRESHOLD=0)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="a setting for every job (repeatable), e.g. BYTEPS_FUSION_CYCLE_TIME_MS=1")
    ap.add_argument("--out-dir")
    args = ap.parse_args(argv)
    if args.reps < 0:
        ap.error("--reps: a number of repetitions, or 0 for the default")

    in_flight = [int(k) for k in args.in_flight.split(",")]
    cases = make_cases(in_flight, common.parse_size(args.bytes), args.quick, args.reps)
    extra = dict(item.split("=", 1) for item in args.env)
    enc = {**extra, "BYTEPS_ENCRYPTION": "0" if args.encryption == "off" else "1"}
    paths = {"numpy": ("bps_numpy.py", enc)}
    if not args.no_tf_op:
        paths["TF op"] = ("bps_tf_op.py", enc)
        # The tensors made inside the function, as a train step's gradients.
        paths[IN_GRAPH] = ("bps_tf_op.py", {**enc, "BPS_BENCH_TF_INPUTS": "variables"})
    if args.compare_fusion:
        paths["TF op unfused"] = ("bps_tf_op.py", {**enc, "BYTEPS_FUSION_THRESHOLD": "0"})
    if args.encryption == "all":
        paths[CURVE] = ("bps_numpy.py", {**extra, "BYTEPS_ENCRYPTION": "curve"})
    if args.encryption in ("both", "all"):
        # The --env settings too (BYTEPS_ENABLE_IPC=0 compares over TCP).
        paths[UNENCRYPTED] = ("bps_numpy.py", {**extra, "BYTEPS_ENCRYPTION": "0"})
        if not args.no_tf_op:
            paths[IN_GRAPH_CLEAR] = ("bps_tf_op.py", {**extra, "BYTEPS_ENCRYPTION": "0",
                                                      "BPS_BENCH_TF_INPUTS": "variables"})
    measured = {name: [] for name in paths}
    with common.stop_on_signals():
        for rnd in range(args.rounds):
            for name, (script, env) in paths.items():
                print(f"[round {rnd + 1}/{args.rounds}] {name} ...", flush=True)
                measured[name].append(run(cases, script, args.workers, args.servers, env))

    rows = []
    for case in cases:
        k = case["in_flight"]
        row = {"in_flight": k}
        for name in paths:
            runs = [m[case["label"]] for m in measured[name]]
            med = median([m["median_s"] for m in runs])
            row[name] = {"median_s": med, "rounds_median_s": [m["median_s"] for m in runs],
                         "reps": runs[0]["reps"], "push_pulls_per_s": k / med,
                         "latency_ms": med * 1e3}
        for key, num, den in (("encrypted_over_unencrypted_time", "numpy", UNENCRYPTED),
                              ("in_graph_encrypted_over_unencrypted_time", IN_GRAPH,
                               IN_GRAPH_CLEAR),
                              ("curve_over_unencrypted_time", CURVE, UNENCRYPTED)):
            if num in paths and den in paths:   # per round, then the median
                pairs = zip(row[num]["rounds_median_s"], row[den]["rounds_median_s"])
                row[key] = median([a / b for a, b in pairs])
        rows.append(row)
    both = UNENCRYPTED in paths
    headers = ["in flight"] + [f"{n} push_pulls/s" for n in paths] + \
        [f"{n} ms per batch" for n in paths] + (["enc/no-enc time"] if both else []) + \
        (["curve/no-enc time"] if CURVE in paths else []) + \
        (["in-graph enc/no-enc time"] if IN_GRAPH_CLEAR in paths else [])
    common.print_table(
        f"{args.bytes} push_pulls, {args.workers} workers x {args.servers} server on loopback",
        headers, [[r["in_flight"]] + [r[n]["push_pulls_per_s"] for n in paths] +
                  [r[n]["latency_ms"] for n in paths] +
                  ([r["encrypted_over_unencrypted_time"]] if both else []) +
                  ([r["curve_over_unencrypted_time"]] if CURVE in paths else []) +
                  ([r["in_graph_encrypted_over_unencrypted_time"]] if IN_GRAPH_CLEAR in paths
                   else []) for r in rows])
    common.write_json("small_tensors", {
        "encryption": args.encryption, "rounds": args.rounds, "env": extra,
        "workers": args.workers, "servers": args.servers, "tensor_bytes":
        common.parse_size(args.bytes), "rows": rows,
        "targets": {"push_pulls_per_s": ">= 5000"}}, args.out_dir)
    return 0


if __name__ == "__main__":
    common.run_main(main)
