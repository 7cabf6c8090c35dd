"""Regenerates the settings table of docs/configuration.md from bps_tf/runtime/config.py.

    python tools/gen_config_doc.py          # rewrite the table
    python tools/gen_config_doc.py --check  # exit 1 if the doc is stale
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bps_tf.runtime import config  # noqa: E402  (no TensorFlow, no native code)

DOC = os.path.join(ROOT, "docs", "configuration.md")
HEADER = "| variable | default | meaning |"


def table() -> str:
    rows = [HEADER, "|---|---|---|"]
    rows += [f"| `{s.env}` | `{s.default}` | {s.doc} |" for s in config.SETTINGS]
    return "\n".join(rows) + "\n"


def rendered(text: str) -> str:
    start = text.index(HEADER)
    end = text.index("\n\n", start) + 1 if "\n\n" in text[start:] else len(text)
    return text[:start] + table() + text[end:]


def main() -> int:
    with open(DOC) as f:
        text = f.read()
    new = rendered(text)
    if "--check" in sys.argv:
        return 0 if new == text else 1
    with open(DOC, "w") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
