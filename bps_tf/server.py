"""`python -m bps_tf.server`: run this node's server (or scheduler) role.

Never imports TensorFlow: parameter servers are cheap CPU processes that
start in a fraction of a second.
"""
from __future__ import annotations

import sys

from bps_tf import cluster, config
from bps_tf._loader import load_core


def main(argv=None) -> int:
    try:
        spec = cluster.resolve()
    except ValueError as exc:
        print(f"bps_tf server: {exc}", file=sys.stderr)
        return 2
    if spec.role not in ("server", "scheduler"):
        print(f"bps_tf server: this node's role is '{spec.role}', not server or scheduler "
              "(set DMLC_ROLE=server or a TF_CONFIG task of type 'ps')", file=sys.stderr)
        return 2
    values = dict(config.core_settings())
    values.update(spec.core_values())
    code, error = load_core().server_run(config.to_core_text(values))
    if code != 0:
        print(f"bps_tf {spec.role}: {error}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
