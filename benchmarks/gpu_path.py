"""The GPU path end to end (device -> pinned host -> servers -> device) against
the CPU path, without TensorFlow.

    python benchmarks/gpu_path.py [--quick] [--sizes 4MiB,16MiB,64MiB,256MiB]
        [--workers 2] [--servers 1] [--lib build/gpu/libbps_gpu_reduce.so] [--emulate]

W worker processes share the GPU, S servers on loopback. Each worker runs the
steps of the TF GPU kernel (benchmarks/workers/gpu_path.py says which) with
CuPy buffers and the CUDA kernels of bps_tf/core/gpu/gpu_reduce.cu:

1. exact sums for float16, bfloat16, float32 and float64, sizes from 0 to
   3 partitions, compared bit for bit on every worker;
2. per size, the median time of each phase of the GPU path and of the CPU
   path's push_pull (pageable host memory), interleaved in the same run, and
   the cost of allocating a fresh pinned buffer (what reuse saves).

Needs a CUDA GPU, CuPy and the kernel library (`python tests/gpu/harness.py
--build` builds it). --emulate runs the same steps on the CPU emulation of the
kernels (no GPU; for trying the script, its times mean nothing).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.common import PYTHON, WORKERS_DIR, fmt_size  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_LIB = REPO / "build" / "gpu" / "libbps_gpu_reduce.so"
PARTITION_BYTES = 2_048_000  # the core's default (kDefaultPartitionBytes)


def summarize(results):
    """(failed checks, rows): the phases' medians, the slowest worker's per phase."""
    failed = [f"worker {r['rank']}: {c['dtype']} x {c['count']} (first bad element "
              f"{c['first_bad']})" for r in results for c in r["checks"] if not c["correct"]]
    rows = []
    for i, med in enumerate(results[0]["medians"]):
        per = [r["medians"][i] for r in results]
        row = {k: max(p[k] for p in per) for k in med if k != "bytes"}
        row["bytes"] = med["bytes"]
        row["gpu_over_cpu"] = row["total"] / row["cpu_push_pull"]
        row["copies_share"] = (row["d2h"] + row["h2d"]) / row["total"]
        rows.append(row)
    return failed, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4MiB,16MiB,64MiB,256MiB")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--lib", default=str(DEFAULT_LIB))
    ap.add_argument("--emulate", action="store_true",
                    help="CPU emulation of the kernels, host memory for device memory")
    ap.add_argument("--out-dir", default=None, help="where the JSON goes (default: results/)")
    args = ap.parse_args(argv)
    if not os.path.exists(args.lib):
        print(f"{args.lib} does not exist: build it with `python tests/gpu/harness.py --build` "
              f"(or --emulate there for the emulation build)")
        return 2
    sizes = common.parse_sizes(args.sizes)
    with common.processes() as procs:
        spec = common.write_spec(procs.log_dir, {
            "out_dir": str(procs.log_dir), "lib": args.lib, "emulate": args.emulate,
            "partition_bytes": PARTITION_BYTES, "sizes": sizes,
            "check_dtypes": ["float16", "bfloat16", "float32", "float64"],
            "warmup": 2, "reps": 4 if args.quick else args.reps,
            "rep_budget_bytes": (1 if args.quick else 4) << 30})
        env = {"BYTEPS_PARTITION_BYTES": str(PARTITION_BYTES)}
        common.run_bps_job(procs, [PYTHON, str(WORKERS_DIR / "gpu_path.py"), str(spec)],
                           num_workers=args.workers, num_servers=args.servers, env=env,
                           timeout=1200)
        results = common.read_results(procs.log_dir, args.workers)
    failed, rows = summarize(results)
    checked = sum(len(r["checks"]) for r in results)
    print(f"device: {results[0]['device']}; {args.workers} workers x {args.servers} servers")
    print(f"exact sums: {checked - len(failed)} of {checked} checks passed "
          f"(float16, bfloat16, float32, float64; 0 to 3 partitions of {PARTITION_BYTES} bytes)")
    for f in failed:
        print("  WRONG " + f)
    ms = lambda s: s * 1e3  # noqa: E731
    common.print_table(
        "GPU path vs CPU path (float32, median ms, slowest worker; 2 local inputs reduced on "
        "the GPU)",
        ["size", "CPU push_pull", "GPU reduce", "D2H", "push_pull", "H2D", "GPU total",
         "GPU/CPU", "copies %", "fresh pinned alloc"],
        [[fmt_size(r["bytes"]), ms(r["cpu_push_pull"]), ms(r["reduce"]), ms(r["d2h"]),
          ms(r["push_pull"]), ms(r["h2d"]), ms(r["total"]), r["gpu_over_cpu"],
          100 * r["copies_share"], ms(r["pinned_alloc_s"])] for r in rows])
    common.write_json("gpu_path", {
        "device": results[0]["device"], "workers": args.workers, "servers": args.servers,
        "emulated": args.emulate, "checks": checked, "wrong": failed, "rows": rows},
        args.out_dir)
    return 1 if failed else 0


if __name__ == "__main__":
    common.run_main(main)
