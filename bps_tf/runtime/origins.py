"""Where a node's place in the job came from, in the words its user configured it with.

Messages about the cluster's size or the scheduler's address name these
(the core gets them as ``scheduler_origin`` and ``members_origin``): a
TF_CONFIG user reads about TF_CONFIG's lists, a ``bpslaunch -np`` user
about its options, and only those who set ``DMLC_*`` variables by hand
about those variables.

No TensorFlow here.
"""
from __future__ import annotations

# Set by bpslaunch -np on the processes it starts: its own options
# ("bpslaunch -np 2 --servers 1"), which made their DMLC_* variables.
LAUNCHED_BY = "BYTEPS_LAUNCHED_BY"


def scheduler(source: str, launched_by: str = "") -> str:
    """Where the scheduler's address came from: "TF_CONFIG's ps task 0", ..."""
    if source == "TF_CONFIG":
        return "TF_CONFIG's ps task 0"
    if source == "Kubernetes":
        return "server 0's pod name (DMLC_PS_ROOT_URI overrides it)"
    if launched_by:
        return "bpslaunch's scheduler"
    return "DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT"


def members(source: str, launched_by: str = "") -> str:
    """Where the numbers of workers and servers came from (a Kubernetes pod
    reads them from DMLC_NUM_WORKER/DMLC_NUM_SERVER too)."""
    if source == "TF_CONFIG":
        return "TF_CONFIG's cluster (its chief, worker and ps tasks)"
    if launched_by:
        return launched_by
    return "DMLC_NUM_WORKER/DMLC_NUM_SERVER"
