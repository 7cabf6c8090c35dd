"""Samples the byte counters of the bridge ports of a NetnsHosts switch, to
see how busy each host's link is over time (run inside the switch namespace).

Usage: link_monitor.py OUT.json PORT [PORT ...]. Every 5 ms until SIGTERM it
records (time, tx_bytes, rx_bytes) per port; a port's tx is what its host
downloads, its rx what the host uploads.
"""
import json
import signal
import sys
import time

out_path, ports = sys.argv[1], sys.argv[2:]
files = {p: (open(f"/sys/class/net/{p}/statistics/tx_bytes"),
             open(f"/sys/class/net/{p}/statistics/rx_bytes")) for p in ports}
samples = []
running = True


def stop(signum, frame):
    global running
    running = False


signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
while running:
    row = [time.perf_counter()]
    for p in ports:
        for f in files[p]:
            f.seek(0)
            row.append(int(f.read()))
    samples.append(row)
    time.sleep(0.005)
with open(out_path, "w") as f:
    json.dump({"ports": ports, "columns": "time, then tx,rx per port", "samples": samples}, f)
