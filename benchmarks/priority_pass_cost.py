"""Cost of the C++ priority pass (bps_tf/ops/priority_pass.cc) per graph.

    python benchmarks/priority_pass_cost.py [--steps 3] [--size 64] [--batch 4]

One process, no cluster (the pass runs wherever the op library is loaded):
a tiny tf.function, ResNet-50 (keras.applications, weights=None) trained with
model.fit without a strategy (graphs without push_pull: the pass only scans
the node list), then under BytePSStrategy (the train graph holds one push_pull
per gradient). The pass times itself (steady clock around Run) and keeps
per-process totals, read through bps_priority_pass_stats_json. Prints a table
and writes benchmarks/results/priority_pass_cost.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402


def _pct(sorted_values, q):
    index = min(len(sorted_values) - 1, int(round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]


def _installed_env():
    """The caller's environment without the source tree on PYTHONPATH: the
    worker must import the installed bps_tf (the tree has no native parts)."""
    env = common.child_env()
    paths = [p for p in env["PYTHONPATH"].split(":") if p and p != str(common.REPO)]
    env["PYTHONPATH"] = ":".join(paths)
    return env


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--size", type=int, default=64, help="image side (>= 32)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    worker = common.WORKERS_DIR / "priority_pass_worker.py"
    proc = subprocess.run([common.PYTHON, str(worker), str(args.steps), str(args.size),
                           str(args.batch)], cwd=tempfile.gettempdir(),
                          env=_installed_env(), capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"worker failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])

    rows = []
    for phase in ("tiny_function", "resnet50_fit_without_strategy", "resnet50_fit_under_strategy"):
        samples = result[phase].pop("samples")
        result[phase]["summary"] = {}
        for has, kind in ((0, "without push_pull"), (1, "with push_pull")):
            mine = [(nodes, ns) for h, nodes, ns in samples if h == has]
            if not mine:
                continue
            costs = sorted(ns / 1e3 for _, ns in mine)
            biggest = max(nodes for nodes, _ in mine)
            at_biggest = sorted(ns / 1e3 for nodes, ns in mine if nodes == biggest)
            summary = {"graphs": len(mine), "median_us": _pct(costs, 50),
                       "p99_us": _pct(costs, 99), "max_us": costs[-1],
                       "largest_graph_nodes": biggest,
                       "largest_graph_us": _pct(at_biggest, 50)}
            result[phase]["summary"][kind] = summary
            rows.append([phase, kind, len(mine), summary["median_us"], summary["p99_us"],
                         summary["max_us"], biggest, summary["largest_graph_us"]])
    common.print_table("Priority pass cost per graph (us; one run of the pass per graph)",
                       ["phase", "graphs", "count", "median", "p99", "max", "largest graph",
                        "us on it"], rows)
    print(f"\nResNet-50: {result['trainable_variables']} trainable variables, "
          f"{args.steps} steps of {args.batch} images {args.size}x{args.size}; fit took "
          f"{result['fit_seconds_plain']:.1f} s plain, {result['fit_seconds_strategy']:.1f} s "
          "under BytePSStrategy (tracing included)")
    common.write_json("priority_pass_cost", result, args.out_dir)
    print(json.dumps({k: v["summary"] for k, v in result.items() if isinstance(v, dict)}))


if __name__ == "__main__":
    common.run_main(main)
