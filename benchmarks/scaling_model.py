"""A calibrated model of a step's communication time: bps_tf's parameter
servers against ring all-reduce, from measured per-byte costs, projected to
8-1,024 workers on 10/25/100 Gbit links; and how many servers (and cores per
server) a model and a network need (docs/scaling.md).

    python benchmarks/scaling_model.py                    # fit + projections
    python benchmarks/scaling_model.py --calibrate-cpu    # measure the CPU terms first (~1 min)
    python benchmarks/scaling_model.py --model bert-large --workers 32 --gbit 25

Inputs, all measured on this machine and read from JSON:
* the link terms: benchmarks/results/ps_edge.json (benchmarks/ps_edge.py:
  n worker + n server namespace hosts, tc-capped links; bps_tf, Horovod-gloo,
  TF's ring and the C++ echo per n);
* the CPU terms: benchmarks/results/scaling_cpu.json (--calibrate-cpu: 2
  workers x 2 servers over loopback TCP, 16 MiB per push_pull back to back;
  core-seconds of the server processes and of the worker processes per byte
  of gradient, from /proc over a steady window).

The model (per step, gradient bytes M, n workers, k servers, link rate B
each way, server cores c; eta = the share of the link's rate TCP achieves):
  push/pull  T = max(M/(eta B), n M/(k eta B_s), n M s/(k c)) + (2 P + d (n-1))/(eta B)
             (worker link, server link, server CPU; the last partition P's way up
              and back is not overlapped; d: the link time, in bytes, that each
              extra worker adds: every partition waits for the slowest of n pushes)
  ring       T = 2(n-1)/n M/(eta_r B) + 2(n-1) a
             (every link carries 2(n-1)/n M; a: the latency of one of the 2(n-1) steps)
eta, d are fitted to bps_tf's points, eta_r and a to Horovod's (TF's ring
separately); the fit is printed point by point (target: within 10 %). The
projection prints the edge with the fitted d and with none (an ideal
fabric, the assumption of BytePS's analysis).
Published reference (BytePS, Jiang et al., OSDI 2020, "A Unified Architecture
for Accelerating Distributed DNN Training in Heterogeneous GPU/CPU
Clusters"): with up to 256 GPUs (32 machines of 8 V100, 100 Gbps RDMA) BytePS
trained up to 84 % faster than all-reduce; the communication-time ceiling of
the same architecture is 2(n-1)/n = 1.94 at 32 machines.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.common import median  # noqa: E402

GBIT = 1e9 / 8
# fp32 gradient bytes of a few models (trainable parameters x 4).
MODELS = {"resnet50": 25.6e6 * 4, "vgg16": 138.4e6 * 4, "bert-large": 336e6 * 4,
          "gpt2-xl": 1.56e9 * 4}
PUBLISHED = [  # (what, machines, Gbit, speedup of BytePS over all-reduce), OSDI'20
    ("BytePS over all-reduce, best case, 256 GPUs", 32, 100, 1.84)]


# ------------------------------------------------------------------ calibration
def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def calibrate_cpu(args) -> dict:
    """Server and worker core-seconds per gradient byte, loopback TCP, clear."""
    n = k = 2
    big = 16 << 20
    with common.processes() as procs:
        out = procs.log_dir / "out"
        out.mkdir()
        spec = common.write_spec(procs.log_dir, {"out_dir": str(out), "interval_s": 0.0,
                                                 "small": 0, "big_elems": big // 4})
        base = common.child_env({"BYTEPS_ENABLE_IPC": "0", "BYTEPS_ENCRYPTION": "0",
                                 "BYTEPS_JOB_TOKEN": "c" * 32, "DMLC_NUM_WORKER": str(n),
                                 "DMLC_NUM_SERVER": str(k), "DMLC_PS_ROOT_URI": common.LOOPBACK,
                                 "DMLC_PS_ROOT_PORT": str(common.free_port()),
                                 "DMLC_NODE_HOST": common.LOOPBACK,
                                 "BYTEPS_BIND_HOST": common.LOOPBACK,
                                 # one 16 MiB tensor, split evenly over the two servers
                                 "BYTEPS_PARTITION_BYTES": str(big // 8)})
        argv = [common.PYTHON, "-m", "bps_tf.server"]
        ready = procs.log_dir / "port"
        sched = procs.start("scheduler", argv, dict(base, DMLC_ROLE="scheduler",
                                                    BYTEPS_READY_FILE=str(ready)))
        common.wait_for_file(procs, ready)
        servers = [procs.start(f"server{i}", argv, dict(base, DMLC_ROLE="server",
                                                        BYTEPS_SERVER_ID=str(i)))
                   for i in range(k)]
        workers = [procs.start(f"worker{r}", [common.PYTHON,
                                              str(common.WORKERS_DIR / "scale_worker.py"),
                                              str(spec)], dict(base, DMLC_ROLE="worker",
                                                               DMLC_WORKER_ID=str(r)))
                   for r in range(n)]
        deadline = time.monotonic() + 120
        while sum(1 for x in os.listdir(out) if x.startswith("first.")) < n:
            procs.check()
            if time.monotonic() > deadline:
                raise common.JobFailed("the calibration job did not start")
            time.sleep(0.05)
        time.sleep(1.0)
        t0 = time.time()
        c0 = [[cpu_seconds(c.popen.pid) for c in g] for g in (servers, workers)]
        time.sleep(args.cpu_window)
        t1 = time.time()
        c1 = [[cpu_seconds(c.popen.pid) for c in g] for g in (servers, workers)]
        (out / "stop").touch()
        procs.wait(workers + servers + [sched], 120)
        records = [json.loads((out / f"worker{r}.json").read_text()) for r in range(n)]
    rounds = median([sum(1 for a, b in r["rounds"] if a >= t0 and b <= t1) for r in records])
    gradient_bytes = rounds * n * big          # pushed by all workers in the window
    server_cpu = sum(b - a for a, b in zip(c0[0], c1[0]))
    worker_cpu = sum(b - a for a, b in zip(c0[1], c1[1]))
    return {"window_s": t1 - t0, "rounds": rounds, "bytes_per_round_per_worker": big,
            "server_core_s_per_byte": server_cpu / gradient_bytes,
            "worker_core_s_per_byte": worker_cpu / gradient_bytes,
            "load": os.getloadavg(),
            "note": "loopback TCP, clear; a byte pushed is also pulled back: per gradient byte "
                    "a server receives it and sends it once, a worker sends and receives it"}


# ------------------------------------------------------------------ the model
def ps_time(n, k, m, b_w, b_s, cores, p, fit, cpu, d=None) -> float:
    """d: bytes' worth of link time each extra worker adds to a step (the
    wait for the slowest of n pushes of every partition; fitted on these
    emulated links); None: the fitted one, 0: an ideal fabric."""
    eta = fit["eta"]
    link_w = m / (eta * b_w)
    link_s = n * m / (k * eta * b_s)
    server_cpu = n * m * cpu["server_core_s_per_byte"] / (k * cores)
    wait = (fit["d"] if d is None else d) * (n - 1) / (eta * b_w)
    return max(link_w, link_s, server_cpu) + 2 * min(p, m) / (eta * b_w) + wait


def ring_time(n, m, b, fit) -> float:
    return 2 * (n - 1) / n * m / (fit["eta"] * b) + 2 * (n - 1) * fit["a"]


def fit_ps(points, cpu) -> dict:
    """eta and d minimising the squared relative error over bps_tf's points."""
    best = None
    for i in range(201):
        for j in range(201):
            f = {"eta": 0.5 + i * 0.0025, "d": j * 10_000.0}
            err = sum((ps_time(q["n"], q["n"], q["m"], q["b"], q["b"], 1e9, q["p"], f, cpu) /
                       q["t_bps"] - 1) ** 2 for q in points)
            if best is None or err < best[0]:
                best = (err, f)
    return best[1]


def fit_ring(points, key) -> dict:
    pts = [q for q in points if q.get(key)]
    if not pts:
        return {}
    best = None
    for i in range(500):
        eta = 0.50 + i * 0.001
        # t = x/eta + y*a with y = 2(n-1): least squares for a >= 0 at fixed eta.
        xs = [2 * (q["n"] - 1) / q["n"] * q["m"] / (eta * q["b"]) for q in pts]
        ys = [2 * (q["n"] - 1) for q in pts]
        a = max(0.0, sum((q[key] - x) * y for q, x, y in zip(pts, xs, ys)) / sum(y * y for y in ys))
        err = sum(((x + a * y) / q[key] - 1) ** 2 for q, x, y in zip(pts, xs, ys))
        if best is None or err < best[0]:
            best = (err, {"eta": eta, "a": a})
    return best[1]


# ps_edge.py's bps_tf columns: the defaults, and BYTEPS_LINK_RATE set to the
# links' rate (its partition size: bps_tf.runtime.config.sized_to_link).
COLUMNS = ("bps_tf", "bps_tf, BYTEPS_LINK_RATE")


def partition_bytes(column: str, rate: float) -> int:
    from bps_tf.runtime import config
    sized = config.sized_to_link(rate) if column != COLUMNS[0] else {}
    return sized.get("partition_bytes", int(config.BY_ENV["BYTEPS_PARTITION_BYTES"].default))


def load_points(path: Path, column: str = "bps_tf"):
    data = json.loads(path.read_text())
    points = []
    for r in data["rows"]:
        t = r["seconds"]
        if column not in t:
            continue
        b = common.parse_rate(r["rate"])
        per_tensor = r["gradient_bytes"] / r["tensors"]
        points.append({"n": r["n"], "m": r["gradient_bytes"], "b": b,
                       "p": min(per_tensor, partition_bytes(column, b)), "t_bps": t[column],
                       "t_hvd": t.get("Horovod-gloo"), "t_ring": t.get("TF ring"),
                       "t_echo": t.get("bound (C++ echo)"), "load": r.get("load_after")})
    return data, points


# ------------------------------------------------------------------ answers
def servers_needed(n, m, b_w, b_s, cpu, cores) -> int:
    """The fewest servers (with `cores` cores and B_s links) that keep a step
    at the workers' own link bound M/B_w."""
    per_server_rate = min(b_s, cores / cpu["server_core_s_per_byte"])
    return max(1, math.ceil(n * m / (per_server_rate * (m / b_w))))


def cores_needed(b_s, cpu) -> float:
    """Cores a server needs to sum what one link of B_s brings in."""
    return b_s * cpu["server_core_s_per_byte"]


def project(args, fits, cpu):
    rows = []
    m = MODELS[args.model] if args.model else None
    models = [args.model] if args.model else list(MODELS)
    sizes = [args.workers] if args.workers else [8, 16, 32, 64, 128, 256, 512, 1024]
    rates = [args.gbit] if args.gbit else [10, 25, 100]
    for name in models:
        m = MODELS[name]
        for gbit in rates:
            b = gbit * GBIT
            cores = max(1, math.ceil(cores_needed(b, cpu)))
            for n in sizes:
                k = servers_needed(n, m, b, b, cpu, cores)
                ps = ps_time(n, k, m, b, b, cores, 1 << 20, fits["bps_tf"], cpu)
                ideal = ps_time(n, k, m, b, b, cores, 1 << 20, fits["bps_tf"], cpu, d=0.0)
                ring = ring_time(n, m, b, fits["ring"]) if fits.get("ring") else float("nan")
                rows.append({"model": name, "gbit": gbit, "n": n, "servers": k,
                             "cores_per_server": cores, "ps_s": ps, "ps_ideal_s": ideal,
                             "ring_s": ring, "edge": ring / ps, "edge_ideal": ring / ideal})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default=str(common.RESULTS_DIR / "ps_edge.json"))
    ap.add_argument("--column", default=COLUMNS[0], choices=COLUMNS,
                    help="which of ps_edge.py's bps_tf columns to fit: the default settings, "
                         "or BYTEPS_LINK_RATE set to the links' rate")
    ap.add_argument("--cpu", default=str(common.RESULTS_DIR / "scaling_cpu.json"))
    ap.add_argument("--calibrate-cpu", action="store_true",
                    help="measure the CPU terms now and write them to --cpu")
    ap.add_argument("--cpu-window", type=float, default=8.0)
    ap.add_argument("--model", choices=sorted(MODELS))
    ap.add_argument("--workers", type=int)
    ap.add_argument("--gbit", type=float)
    ap.add_argument("--out-dir")
    args = ap.parse_args()
    if args.calibrate_cpu:
        cpu = calibrate_cpu(args)
        Path(args.cpu).parent.mkdir(parents=True, exist_ok=True)
        Path(args.cpu).write_text(json.dumps({"environment": common.environment_summary(),
                                              **cpu}, indent=2) + "\n")
        print(f"wrote {args.cpu}")
    cpu = json.loads(Path(args.cpu).read_text())
    print(f"CPU terms ({args.cpu}): a server {cpu['server_core_s_per_byte'] * 1e9:.3f} "
          f"core-ns per gradient byte, a worker {cpu['worker_core_s_per_byte'] * 1e9:.3f}")
    _, points = load_points(Path(args.points), args.column)
    if not points:
        raise SystemExit(f"{args.points} has no column {args.column!r}")
    fits = {"bps_tf": fit_ps(points, cpu), "ring": fit_ring(points, "t_hvd"),
            "tf_ring": fit_ring(points, "t_ring")}
    print(f"fitted: bps_tf eta {fits['bps_tf']['eta']:.3f}, d {fits['bps_tf']['d'] / 1e6:.2f} MB "
          "per extra worker; "
          + (f"Horovod ring eta {fits['ring']['eta']:.3f}, a {fits['ring']['a'] * 1e3:.1f} ms; "
             if fits["ring"] else "Horovod: no points; ")
          + (f"TF ring eta {fits['tf_ring']['eta']:.3f}, a {fits['tf_ring']['a'] * 1e3:.1f} ms"
             if fits["tf_ring"] else "TF ring: no points"))
    fit_rows = []
    for q in points:
        row = [q["n"], f"{q['b'] * 8 / 1e6:.0f} mbit", q["m"] / 1e6]
        model = ps_time(q["n"], q["n"], q["m"], q["b"], q["b"], 1e9, q["p"], fits["bps_tf"], cpu)
        row += [q["t_bps"], model, 100 * (model / q["t_bps"] - 1)]
        for key, f in (("t_hvd", fits["ring"]), ("t_ring", fits["tf_ring"])):
            if q.get(key) and f:
                est = ring_time(q["n"], q["m"], q["b"], f)
                row += [q[key], est, 100 * (est / q[key] - 1)]
            else:
                row += [float("nan")] * 3
        fit_rows.append(row)
    common.print_table("the model against the measured points (error %: model / measured - 1; "
                       "target within 10 %)",
                       ["n", "link", "M MB", "bps_tf s", "model", "err %", "Horovod s", "model",
                        "err %", "TF ring s", "model", "err %"], fit_rows)
    if not fits["ring"]:
        fits["ring"] = fits["tf_ring"]
    rows = project(args, fits, cpu)
    common.print_table(
        "projection: communication time per step with enough servers to reach the worker-link "
        "bound (cores per server to sum one link's bytes), against ring all-reduce",
        ["model", "Gbit", "workers", "servers", "cores/server", "push/pull s", "ring s",
         "ring / push-pull", "same, d = 0"],
        [[r["model"], r["gbit"], r["n"], r["servers"], r["cores_per_server"], r["ps_s"],
          r["ring_s"], r["edge"], r["edge_ideal"]] for r in rows])
    ours = [r for r in rows if r["n"] == 32 and r["gbit"] == 100]
    common.print_table("against BytePS's published result (OSDI'20; end-to-end training speed, "
                       "so at most the communication ratio)",
                       ["published", "machines", "Gbit", "BytePS speedup", "theory 2(n-1)/n",
                        "this model's ring / push-pull (d = 0)"],
                       [[w, n, g, s, 2 * (n - 1) / n,
                         ", ".join(f"{r['model']} {r['edge']:.2f} ({r['edge_ideal']:.2f})"
                                 for r in ours) or "-"]
                        for w, n, g, s in PUBLISHED])
    common.write_json("scaling_model", {"cpu": cpu, "fits": fits, "points": points,
                                        "fit_rows": fit_rows, "projection": rows},
                      args.out_dir)
    return 0


if __name__ == "__main__":
    common.run_main(main)
