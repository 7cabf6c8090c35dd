"""bpslaunch's command line: the options, their checks and the help text."""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from bps_tf.launch.output import PROG

_DESCRIPTION = """\
Start a bps_tf training job and supervise it.

Local mode (-np N): starts a whole cluster on 127.0.0.1: the servers (the
scheduler runs inside server 0) and N workers that run COMMAND, each with
DMLC_WORKER_ID / BYTEPS_LOCAL_RANK set to its rank.

Cluster mode (no -np): starts this host's one process of a larger job, whose
place is read from DMLC_ROLE and the other DMLC_* variables, from TF_CONFIG
(e.g. a Kubeflow TFJob), or from a Kubernetes pod of a JobSet or Indexed Job
(JOB_COMPLETION_INDEX and the job's name; docs/kubernetes.md). Workers, chief
and evaluator run COMMAND; ps, server and scheduler run the bps_tf server and
ignore COMMAND.

Every line the processes print comes out tagged with its origin, e.g.
"[worker 1] loss: 0.25" (--no-prefix: untouched, straight to the terminal).
TensorFlow's C++ start-up messages are hidden (TF_CPP_MIN_LOG_LEVEL=2) unless
TF_CPP_MIN_LOG_LEVEL is set. bpslaunch prints one line when the job starts and
one when it ends, with every process's exit code and time.
"""

_EPILOG = """\
examples:
  bpslaunch -np 4 python train.py --epochs 3
  bpslaunch -np 2 --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh python train.py
  bpslaunch -np 2 --servers 2 --timeout 600 -- python train.py
  bpslaunch -np 2 --health-port 8081 python train.py   # probe with grpc_health_probe
  TF_CONFIG='{"cluster": {...}, "task": {"type": "worker", "index": 0}}' bpslaunch python train.py

On failure (a process exits non-zero or is killed, a server dies early, the
timeout passes, or the launcher gets SIGINT/SIGTERM) every process group is sent
SIGTERM, then SIGKILL after 5 s, and bpslaunch exits non-zero naming the cause.
Exit codes: the failed process's code (1 if it was killed by a signal), 124 on
--timeout, 128+N on signal N, 2 for usage or configuration errors.
"""


def _number(text: str, kind, lowest, inclusive: bool = True):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < lowest or (not inclusive and value == lowest):
        bound = f"at least {lowest}" if inclusive else f"more than {lowest}"
        raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
    return value


def _positive_int(text: str) -> int:
    return _number(text, int, 1)


def _non_negative_int(text: str) -> int:
    return _number(text, int, 0)


def _positive_float(text: str) -> float:
    return _number(text, float, 0, inclusive=False)


def _health_port(text: str) -> int:
    port = _number(text, int, 0)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"must be a port (at most 65535), got {text}")
    return port


def _log_level(text: str) -> str:
    from bps_tf.runtime.config import LOG_LEVELS   # the one table of levels
    level = {"WARN": "WARNING"}.get(text.strip().upper(), text.strip().upper())
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=_DESCRIPTION, epilog=_EPILOG, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-np", "--num-proc", dest="num_proc", type=_positive_int, metavar="N",
                        help="local mode: run N workers on this machine (omit for cluster mode)")
    parser.add_argument("-ns", "--servers", dest="servers", type=_non_negative_int, metavar="S",
                        help="local mode: number of servers (default 1 when N > 1, 0 when N "
                             "is 1; 0 with N = 1 runs COMMAND alone with no cluster)")
    parser.add_argument("--timeout", type=_positive_float, metavar="SECONDS",
                        help="stop the whole job and fail if it runs longer than this")
    parser.add_argument("--shutdown-timeout", type=_positive_float, metavar="SECONDS",
                        help="local mode: at the end, how long the workers may take to exit "
                             "once the servers have (or the servers once the workers have) "
                             "before the job counts as stuck (default 120)")
    parser.add_argument("--no-prefix", dest="prefix", action="store_false",
                        help="do not tag output lines with [worker N] / [server N]: the "
                             "processes write straight to this terminal")
    parser.add_argument("--health-port", type=_health_port, metavar="PORT",
                        help="servers serve the gRPC health service (grpc.health.v1) on this "
                             "port (local mode: server i on PORT+i); default "
                             "BYTEPS_HEALTH_PORT; 0: off")
    parser.add_argument("-H", "--hosts", dest="hosts", metavar="HOST:SLOTS,...",
                        help="local mode: the hosts and their slots (horovodrun's), each a "
                             "name of this machine (localhost, 127.0.0.1, 127.0.0.2, ...; "
                             "two names are two hosts); ranks go host by host. With "
                             "--min-np: an elastic job on these fixed hosts")
    parser.add_argument("--host-exec", dest="host_exec", metavar="PREFIX",
                        help="local mode with hosts (-H or --host-discovery-script): start "
                             "each worker on its host through this command prefix, {host} "
                             "replaced by the host, e.g. 'ip netns exec ns-{host}'; it must "
                             "run the command in place (exec), so that signals reach it. The "
                             "hosts may then be any machines; needs --address")
    parser.add_argument("--address", metavar="ADDR",
                        help="with --host-exec: this machine's address that the hosts reach; "
                             "the scheduler and the servers run here and listen on it")
    parser.add_argument("--log-level", dest="log_level", type=_log_level, metavar="LEVEL",
                        help="BYTEPS_LOG_LEVEL for every process (horovodrun's): TRACE, "
                             "DEBUG, INFO, WARNING, ERROR or FATAL")
    elastic = parser.add_argument_group(
        "elastic training (local mode; Horovod's horovodrun options, docs/elastic.md)")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=_positive_int,
                         metavar="N",
                         help="elastic: go on while at least N workers remain (a lost worker "
                              "no longer stops the job)")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=_positive_int,
                         metavar="N",
                         help="elastic: at most N workers (default: -np; with -H or a "
                              "discovery script, every slot offered, at most 1,024)")
    elastic.add_argument("--host-discovery-script", dest="discovery", metavar="SCRIPT",
                         help="elastic: a command that prints 'host:slots' lines, run again "
                              "every --discovery-interval seconds: new slots get new workers, "
                              "hosts no longer listed lose theirs (this machine's names only)")
    elastic.add_argument("--slots-per-host", "--slots", dest="slots", type=_positive_int,
                         metavar="N", default=1,
                         help="elastic: slots of a discovery line without ':slots' (default 1)")
    elastic.add_argument("--reset-limit", dest="reset_limit", type=_non_negative_int,
                         metavar="N",
                         help="elastic: fail the job once it would reset (change its "
                              "workers) more than N times")
    elastic.add_argument("--blacklist-cooldown-range", dest="cooldown", type=_positive_float,
                         nargs=2, metavar=("MIN", "MAX"),
                         help="elastic: a blacklisted host comes back after a cooldown that "
                              "grows with each blacklisting, between MIN and MAX seconds "
                              "(default: never)")
    elastic.add_argument("--elastic-timeout", dest="elastic_timeout", type=_positive_float,
                         metavar="SECONDS", default=600.0,
                         help="elastic: how long to wait for --min-np workers after a change "
                              "before failing the job (default 600)")
    elastic.add_argument("--discovery-interval", dest="discovery_interval",
                         type=_positive_float, metavar="SECONDS", default=1.0,
                         help="elastic: seconds between runs of the discovery script (default 1)")
    elastic.add_argument("--blacklist-after", dest="blacklist_after", type=_positive_int,
                         metavar="K", default=3,
                         help="elastic without -H or a discovery script: after K failed "
                              "workers this machine gets no new ones (default 3); with hosts, "
                              "a failed worker's host is blacklisted at once")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log what the launcher starts and decides")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND ...",
                        help="the program each worker runs, with its arguments; a '--' "
                             "before it is optional")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    args.elastic = any(v is not None for v in (args.min_np, args.max_np, args.discovery))
    return args


def elastic_options(args: argparse.Namespace) -> dict:
    """What the elastic launcher takes from the command line."""
    return {"min_np": args.min_np, "max_np": args.max_np, "discovery": args.discovery,
            "hosts": args.hosts, "slots": args.slots, "elastic_timeout": args.elastic_timeout,
            "discovery_interval": args.discovery_interval,
            "blacklist_after": args.blacklist_after, "reset_limit": args.reset_limit,
            "cooldown": args.cooldown}
