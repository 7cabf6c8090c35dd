"""Draws two consecutive training steps of an overlapped run from a worker's
timeline (BYTEPS_TRACE_ON, docs/timeline.md) as an SVG picture.

    python benchmarks/timeline_svg.py TRACE.json --step K [--out picture.svg]

One row per variable, in the order of the forward pass (highest priority
first; the graph's priority pass gives the first layer's variables the
highest). On each row: the push_pull of step K (from the moment the
optimizer started it to the moment its sum was back) and of step K+1, and
the *wait* for step K's sum in step K+1 (from the moment TensorFlow ran the
wait, often at the start of the step, to the moment it handed the sum
over). A layer's forward of step K+1 starts once its own wait and every
earlier layer's have ended; a dashed line marks the end of step K's last
push_pull, and a layer whose forward could start left of it computed while
step K's communication was still on the wire. Plain SVG, no plotting
library needed.
"""
from __future__ import annotations

import argparse
import json
from html import escape
from pathlib import Path
from typing import Dict, List, Tuple

COLORS = {"push_pull k": "#3b75af", "push_pull k+1": "#9ec1e3", "wait": "#ef8636"}


def load(trace_path: Path, step: int) -> Tuple[List[str], Dict[Tuple[str, str], Tuple[int, int]]]:
    """Rows (tensor names in the forward order of step+1) and spans keyed by
    (name, kind) with kind in 'push_pull k', 'push_pull k+1', 'wait'."""
    events = [e for e in json.loads(Path(trace_path).read_text())["traceEvents"]
              if e.get("ph") == "X"]
    spans = {}
    labels = {}
    for e in events:
        name, s = e["args"].get("tensor_name"), e["args"].get("step")
        if name is None:
            continue
        if e["cat"] == "push_pull":
            labels[name] = e["name"]  # the variable's label, when it has one
        end = e["ts"] + e["dur"]
        if e["cat"] == "push_pull" and s in (step, step + 1):
            spans[(name, "push_pull k" if s == step else "push_pull k+1")] = (e["ts"], end)
        elif e["cat"] == "overlap" and s == step:
            spans[(name, "wait")] = (e["ts"], end)
    priority = {e["args"]["tensor_name"]: e["args"].get("priority", 0) for e in events
                if e["cat"] == "push_pull" and e["args"].get("step") == step}
    # Forward order: highest priority first; among equals (FIFO runs), the
    # gradient started last in the backward pass belongs to an earlier layer.
    rows = sorted({n for n, kind in spans if kind == "wait" and (n, "push_pull k") in spans},
                  key=lambda n: (-priority.get(n, 0), -spans[(n, "push_pull k")][0]))
    if not rows:
        raise SystemExit(f"{trace_path}: no overlapped wait of step {step} "
                         "(was the run overlapped, and the step in the traced range?)")
    return [labels.get(n, n) for n in rows], {
        (labels.get(n, n), kind): v for (n, kind), v in spans.items() if n in set(rows)}


def overlapped_layers(rows, spans) -> int:
    """How many variables' layers of step K+1 could start their forward before
    step K's last push_pull ended (rows in forward order: a layer also waits
    for every earlier one)."""
    last = max(spans[(r, "push_pull k")][1] for r in rows)
    ready, count = 0, 0
    for r in rows:
        ready = max(ready, spans[(r, "wait")][1])
        count += ready < last
    return count


def render(rows, spans, title: str) -> str:
    t0 = min(a for a, _ in spans.values())
    t1 = max(b for _, b in spans.values())
    left, width, row_h, top = 260, 900, 18, 50
    scale = width / max(1, t1 - t0)
    height = top + row_h * len(rows) + 60
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" '
           f'height="{height}" font-family="sans-serif" font-size="11">',
           f'<text x="10" y="18" font-size="13">{escape(title)}</text>']
    for i, (kind, color) in enumerate(COLORS.items()):
        x = left + i * 190
        out.append(f'<rect x="{x}" y="28" width="12" height="10" fill="{color}"/>'
                   f'<text x="{x + 16}" y="37">{escape(kind if kind != "wait" else "wait for step k sum (then forward)")}</text>')
    for i, row in enumerate(rows):
        y = top + i * row_h
        out.append(f'<text x="{left - 6}" y="{y + 12}" text-anchor="end">{escape(row[:40])}</text>')
        for kind, color in COLORS.items():
            if (row, kind) not in spans:
                continue
            a, b = spans[(row, kind)]
            h = 6 if kind == "wait" else 12
            dy = 3 if kind == "wait" else 0
            out.append(f'<rect x="{left + (a - t0) * scale:.1f}" y="{y + dy}" '
                       f'width="{max(1.0, (b - a) * scale):.1f}" height="{h}" fill="{color}" '
                       f'opacity="0.9"><title>{escape(row)} {kind}: {(b - a) / 1000:.1f} ms'
                       f'</title></rect>')
    last = max(spans[(r, "push_pull k")][1] for r in rows if (r, "push_pull k") in spans)
    x = left + (last - t0) * scale
    out.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{top + row_h * len(rows)}" '
               'stroke="black" stroke-dasharray="4,3"/>')
    out.append(f'<text x="{x + 4:.1f}" y="{top + row_h * len(rows) + 14}">'
               "step k's last push_pull done</text>")
    ticks = max(1, int((t1 - t0) / 1000 / 8))
    for ms in range(0, int((t1 - t0) / 1000) + 1, ticks):
        tx = left + ms * 1000 * scale
        out.append(f'<line x1="{tx:.1f}" y1="{height - 30}" x2="{tx:.1f}" y2="{height - 25}" '
                   'stroke="gray"/>'
                   f'<text x="{tx:.1f}" y="{height - 12}" text-anchor="middle">{ms} ms</text>')
    out.append("</svg>")
    return "\n".join(out)


def draw(trace_path: Path, step: int, out: Path, title: str = "") -> int:
    rows, spans = load(trace_path, step)
    n = overlapped_layers(rows, spans)
    title = title or f"{Path(trace_path).name}: steps {step} and {step + 1}"
    out.write_text(render(rows, spans, f"{title} -- {n} of {len(rows)} variables' layers of "
                                       f"step {step + 1} could start before step {step}'s "
                                       "communication ended"))
    print(f"wrote {out} ({n} of {len(rows)} variables' layers overlapped)")
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    draw(Path(args.trace), args.step, Path(args.out or Path(args.trace).with_suffix(".svg")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
