"""How busy each emulated host's link was during the timed steps, from the
samples benchmarks/workers/link_monitor.py takes (netns_cluster.py --monitor).

    python benchmarks/link_usage.py benchmarks/results/netns_links_1gbit.json --rate 1gbit

Prints, per host and direction, the average rate during the steps as a
fraction of the cap, and the share of 20 ms bins in which the link ran
above 80 % of the cap; plots one step's time series. A link that is busy
all the time at the cap means the data movement is as good as it gets; idle
bins while other links are busy point at the order or placement of
partitions; links busy below the cap point at the CPUs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

BIN_S = 0.02


def _series(data, port_index: int, column: int):
    """(times, bytes) of one counter; column 0 = tx (download), 1 = rx (upload)."""
    times = [row[0] for row in data["samples"]]
    values = [row[1 + 2 * port_index + column] for row in data["samples"]]
    return times, values


def _bytes_between(times, values, t0: float, t1: float) -> float:
    def at(t):
        # The sample counter at or before t (5 ms resolution is plenty).
        lo, hi = 0, len(times) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if times[mid] <= t:
                lo = mid
            else:
                hi = mid - 1
        return values[lo]
    return at(t1) - at(t0)


def summarize(data, rate_bytes: float):
    steps = data["steps"]
    rows = []
    for i, host in enumerate(data["hosts"]):
        row = {"host": host}
        for column, direction in ((1, "upload"), (0, "download")):
            times, values = _series(data, i, column)
            moved = sum(_bytes_between(times, values, a, b) for a, b in steps)
            busy = total = 0
            for a, b in steps:
                t = a
                while t + BIN_S <= b:
                    total += 1
                    if _bytes_between(times, values, t, t + BIN_S) >= 0.8 * rate_bytes * BIN_S:
                        busy += 1
                    t += BIN_S
            seconds = sum(b - a for a, b in steps)
            row[f"{direction}_fraction_of_cap"] = moved / seconds / rate_bytes
            row[f"{direction}_busy_bins"] = busy / total if total else float("nan")
        rows.append(row)
    return rows


def plot(data, rate_bytes: float, path: Path, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    steps = data["steps"]
    durations = [b - a for a, b in steps]
    a, b = steps[sorted(range(len(steps)), key=durations.__getitem__)[len(steps) // 2]]
    fig, axes = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    for column, ax, direction in ((1, axes[0], "upload"), (0, axes[1], "download")):
        for i, host in enumerate(data["hosts"]):
            times, values = _series(data, i, column)
            xs, ys = [], []
            t = a
            while t + BIN_S <= b:
                xs.append(t - a)
                ys.append(_bytes_between(times, values, t, t + BIN_S) / BIN_S / 1e6)
                t += BIN_S
            ax.plot(xs, ys, label=host, linewidth=1,
                    linestyle="-" if host.startswith("worker") else "--")
        ax.axhline(rate_bytes / 1e6, color="k", linewidth=0.8)
        ax.set_ylabel(f"{direction} MB/s")
        ax.grid(True, alpha=0.3)
    axes[0].set_title(title)
    axes[0].legend(fontsize=7, ncol=4)
    axes[1].set_xlabel("seconds into the median step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def report(path: Path, rate: str) -> list:
    data = json.loads(path.read_text())
    rate_bytes = common.parse_rate(rate)
    rows = summarize(data, rate_bytes)
    common.print_table(
        f"link use during the steps at {rate} (fraction of the cap; share of 20 ms bins "
        f"above 80 % of the cap)",
        ["host", "upload", "upload busy", "download", "download busy"],
        [[r["host"], r["upload_fraction_of_cap"], r["upload_busy_bins"],
          r["download_fraction_of_cap"], r["download_busy_bins"]] for r in rows])
    plot(data, rate_bytes, path.with_suffix(".png"),
         f"bps_tf link use per host, one step at {rate}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("samples", type=Path)
    ap.add_argument("--rate", required=True)
    args = ap.parse_args(argv)
    report(args.samples, args.rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
