"""Lists a Kubernetes job's worker pods from its headless Service's DNS, as ``host:slots`` lines.

    python -m bps_tf.launch.k8s_discovery --jobset NAME [--replicated-job worker]
    python -m bps_tf.launch.k8s_discovery --job NAME-worker --service NAME

For ``bpslaunch --host-discovery-script`` (and ``horovodrun``'s), run where a
launcher starts the workers on the pods it discovers: it needs no API
credentials (no ServiceAccount, no ``kubectl``), only the cluster's DNS. The
pods of an Indexed Job (a JobSet's Jobs are Indexed Jobs) have predictable
stable names, so the helper asks DNS for each index from 0 to ``--max-pods``
- 1 and prints the names that resolve, in index order:

* JobSet: ``<jobset>-<replicated job>-<job index>-<pod index>.<subdomain>``
  (pods numbered by pod, ``replicas: 1``; ``--by-job`` numbers them by Job);
* Indexed Job behind a headless Service: ``<job>-<index>.<service>``.

A name resolves while its pod exists and has an IP (the Service must publish
not-ready addresses, as JobSet's does by default): a pod that was deleted,
evicted or not yet scheduled is not listed, and a scaled-up one is, so the
lines follow the worker count. Each host gets ``--slots`` slots (default 1:
one worker process per pod).

``BYTEPS_K8S_TEST_HOSTS`` (tests only) replaces DNS: exactly the names it maps
resolve. No TensorFlow here.
"""
from __future__ import annotations

import argparse
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence

from bps_tf.runtime import k8s_cluster

DEFAULT_MAX_PODS = 64      # bps_tf's most workers (BYTEPS_ELASTIC_MAX_WORKERS)


def pod_names(args: argparse.Namespace) -> List[str]:
    """Every stable name a pod of the job may have, index 0 first."""
    if args.jobset:
        subdomain = args.subdomain or args.jobset
        base = f"{args.jobset}-{args.replicated_job}"
        return [f"{base}-{i}-0.{subdomain}" if args.by_job else f"{base}-0-{i}.{subdomain}"
                for i in range(args.max_pods)]
    return [f"{args.job}-{i}.{args.service}" for i in range(args.max_pods)]


def dns_resolves(name: str) -> bool:
    try:
        return bool(socket.getaddrinfo(name, None, type=socket.SOCK_STREAM))
    except (socket.gaierror, UnicodeError):
        return False


def discover(names: Sequence[str], resolves: Callable[[str], bool]) -> List[str]:
    """The names that resolve now, in the given order (looked up in parallel)."""
    with ThreadPoolExecutor(max_workers=16) as pool:
        found = list(pool.map(resolves, names))
    return [name for name, ok in zip(names, found) if ok]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bps_tf.launch.k8s_discovery",
        description="Print host:slots for each pod of a Kubernetes job found in DNS.")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--jobset", metavar="NAME", help="the JobSet (or TrainJob) name")
    which.add_argument("--job", metavar="NAME", help="the Indexed Job's name (with --service)")
    parser.add_argument("--replicated-job", default="worker", metavar="NAME",
                        help="JobSet: the workers' replicated job (default worker; "
                             "Trainer v2: node)")
    parser.add_argument("--subdomain", metavar="NAME",
                        help="JobSet: spec.network.subdomain, if set (default: the JobSet name)")
    parser.add_argument("--by-job", action="store_true",
                        help="JobSet: one pod per Job (replicas: N, parallelism: 1)")
    parser.add_argument("--service", metavar="NAME",
                        help="Indexed Job: the headless Service (the pods' subdomain)")
    parser.add_argument("--max-pods", type=int, default=DEFAULT_MAX_PODS, metavar="N",
                        help=f"look for pod indexes 0..N-1 (default {DEFAULT_MAX_PODS})")
    parser.add_argument("--slots", type=int, default=1, metavar="K",
                        help="slots per pod (default 1: one worker process per pod)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.job and not args.service:
        parser.error("--job needs --service, the headless Service the pods' names are under")
    if args.max_pods < 1 or args.slots < 1:
        parser.error("--max-pods and --slots must be at least 1")
    resolves = dns_resolves
    try:
        table = k8s_cluster.host_overrides()
    except ValueError as exc:
        print(f"k8s_discovery: {exc}", file=sys.stderr)
        return 2
    if table:
        resolves = table.__contains__
    for name in discover(pod_names(args), resolves):
        print(f"{name}:{args.slots}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
