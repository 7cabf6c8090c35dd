"""The CPU sampler of benchmarks/cpu_per_byte.py counts the time of threads
that have exited: the C++ echo's client starts a thread per connection for
every repetition, and a sampler that summed live threads only put the echo
at half its real CPU (and bps_tf at 3x the echo instead of 1.3x)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.cpu_per_byte import _cpu_ns  # noqa: E402

BURN_S = 0.15
THREADS = 4

# Each thread burns BURN_S of its own CPU and exits; the process then idles
# until told to quit, so the sampler reads it after every burner is gone.
CHILD = f"""
import sys, threading, time
def burn():
    t = time.thread_time()
    while time.thread_time() - t < {BURN_S}:
        pass
for _ in range({THREADS}):
    th = threading.Thread(target=burn)
    th.start()
    th.join()
print("burned", flush=True)
sys.stdin.readline()
"""


def test_cpu_of_exited_threads_is_counted():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "burned"
        counted_s = _cpu_ns(child.pid) / 1e9
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    # Every burner has exited: their CPU (THREADS x BURN_S) must still be
    # there, read to the 10 ms tick of /proc/PID/stat.
    assert counted_s >= THREADS * BURN_S - 0.03, counted_s
    # ... and not invented: the interpreter's start-up adds well under 5 s.
    assert counted_s < THREADS * BURN_S + 5, counted_s

