"""Horovod's gloo rendezvous for ranks that horovodrun cannot start.

horovodrun reaches hosts other than this one through ssh; namespace hosts
have none. This starts the same rendezvous server horovodrun starts (from
the Horovod install in benchmarks/.hvd-venv), with the slots of HOSTS
("ip:slots,ip:slots"), writes its port to PORT_FILE and serves until killed;
benchmarks/hvd_peer.py then starts every rank with the variables horovodrun
would give it.

Usage: hvd_rendezvous.py HOSTS NUM_PROC PORT_FILE
"""
import json
import os
import signal
import sys

from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
from horovod.runner.http.http_server import RendezvousServer


def main():
    hosts, num_proc, port_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    plan = get_host_assignments(parse_hosts(hosts), num_proc)
    server = RendezvousServer(False)
    port = server.start()
    server.init(plan)
    slots = [{"hostname": s.hostname, "rank": s.rank, "size": s.size,
              "local_rank": s.local_rank, "local_size": s.local_size,
              "cross_rank": s.cross_rank, "cross_size": s.cross_size} for s in plan]
    with open(port_file + ".tmp", "w") as f:
        json.dump({"port": port, "slots": slots}, f)
    os.replace(port_file + ".tmp", port_file)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    main()
