"""bpslaunch's output: every line tagged with its process, never two processes
within one line; one start line and one end line; --no-prefix.

These run the real CLI (`python -m bps_tf.launch`) with real servers and
numpy-only workers (no TensorFlow), from a neutral working directory.
"""
import os
import re
import subprocess
import sys
import tempfile

import pytest

from bps_tf.launch import environments, output as launch_output, procs

LINES = 400
LONG = 6000      # longer than a pipe's atomic write (4096): must still stay whole

CHATTY = r'''
import os, sys
import bps_tf
from bps_tf.runtime import basics
bps_tf.init()
rank = basics.rank()
lines, long = int(sys.argv[1]), int(sys.argv[2])
out = sys.stdout
for i in range(lines):
    width = long if i % 40 == 7 else i % 90
    # Written in pieces, as print() with several arguments does.
    out.write(f"r{rank} n{i} ")
    out.write(str(rank) * width)
    out.write("\n")
    if i % 50 == 0:
        print(f"r{rank} e{i} " + str(rank) * 30, file=sys.stderr)
sys.stdout.buffer.write(b"r%d raw \xff\xfe\n" % rank)
out.write(f"r{rank} partial")
out.flush()
basics.shutdown()
'''

START = re.compile(r"^bpslaunch: starting 2 workers and 1 server on 127\.0\.0\.1: scheduler in "
                   r"server 0 on port \d+; job token generated for this job$")
END = re.compile(r"^bpslaunch: job finished after [\d.]+ s: server 0 exit 0 \([\d.]+ s\), "
                 r"worker 0 exit 0 \([\d.]+ s\), worker 1 exit 0 \([\d.]+ s\)$")


def _bpslaunch(args, tmp_path, **env):
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    full = {k: v for k, v in os.environ.items() if k not in environments.PLACEMENT_VARIABLES}
    full.pop("BYTEPS_JOB_TOKEN", None)
    full.pop("TF_CPP_MIN_LOG_LEVEL", None)
    full.update(env)
    cmd = [sys.executable, "-m", "bps_tf.launch", "--timeout", "60", *args,
           sys.executable, str(script), str(LINES), str(LONG)]
    return subprocess.run(cmd, env=full, capture_output=True, timeout=90,
                          cwd=tempfile.gettempdir())


def test_every_line_is_tagged_and_whole(tmp_path):
    proc = _bpslaunch(["-np", "2", "--servers", "1"], tmp_path)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
    seen = {0: [], 1: []}
    for line in out.split(b"\n")[:-1]:
        match = re.fullmatch(rb"\[worker (\d)\] r(\d) (.*)", line, re.S)
        assert match, line[:200]
        rank = int(match.group(1))
        assert int(match.group(2)) == rank, line[:200]     # the tag names the writer
        body = match.group(3)
        if body.startswith(b"n"):
            number, _, fill = body.partition(b" ")
            # A line of another process inside this one would break the fill.
            assert fill == str(rank).encode() * len(fill), line[:200]
            seen[rank].append(int(number[1:]))
            if int(number[1:]) % 40 == 7:
                assert len(fill) == LONG
        else:
            seen[rank].append(body)
    for rank in (0, 1):
        numbers = [x for x in seen[rank] if isinstance(x, int)]
        assert numbers == list(range(LINES)), rank
        # Bytes that are not UTF-8 pass unchanged; a last line without a
        # newline still comes out, ended.
        assert seen[rank][-2:] == [b"raw \xff\xfe", b"partial"]

    err_lines = err.decode("utf-8", errors="replace").splitlines()
    assert START.match(err_lines[0]), err_lines[:3]
    assert END.match(err_lines[-1]), err_lines[-3:]
    tagged = [l for l in err_lines[1:-1] if not l.startswith("bpslaunch:")]
    for rank in (0, 1):
        mine = [l for l in tagged if l.startswith(f"[worker {rank}] r{rank} e")]
        assert len(mine) == LINES // 50, tagged
    assert all(re.fullmatch(r"\[(worker \d|server 0)\] .*", l) for l in tagged), tagged


def test_no_prefix_leaves_the_output_alone(tmp_path):
    proc = _bpslaunch(["-np", "2", "--no-prefix"], tmp_path)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    out = proc.stdout
    assert b"[worker" not in out
    assert out.count(b"r0 n399 ") == 1 and out.count(b"r1 n399 ") == 1
    assert b"r0 partial" in out and b"r1 partial" in out
    err = proc.stderr.decode(errors="replace").splitlines()
    assert START.match(err[0]) and END.match(err[-1]), err


def test_a_failure_is_named_in_the_end_line(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      "print('rank', os.environ['DMLC_WORKER_ID'], flush=True)\n"
                      "if os.environ['DMLC_WORKER_ID'] == '1': sys.exit(3)\n"
                      "time.sleep(30)\n")
    env = {k: v for k, v in os.environ.items() if k not in environments.PLACEMENT_VARIABLES}
    env["BYTEPS_JOB_TOKEN"] = "secret-value-never-shown"
    proc = subprocess.run([sys.executable, "-m", "bps_tf.launch", "-np", "2", "--timeout",
                           "60", sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=90, cwd=tempfile.gettempdir())
    assert proc.returncode == 3
    assert "[worker 1] rank 1" in proc.stdout and "[worker 0] rank 0" in proc.stdout
    err = proc.stderr.splitlines()
    assert "job token from BYTEPS_JOB_TOKEN" in err[0]
    assert "secret-value-never-shown" not in proc.stderr + proc.stdout
    assert re.search(r"worker 1 \(pid \d+\) exited with code 3; stopping", proc.stderr)
    assert re.match(r"bpslaunch: job failed \(exit code 3\) after [\d.]+ s: server 0 .*, "
                    r"worker 0 SIGTERM \([\d.]+ s\), worker 1 exit 3 \([\d.]+ s\)$", err[-1]), err


# A worker whose program raised: it tells the job at once (bps_tf's exit
# handler), then takes long to end (as TensorFlow's teardown does), so the
# server, which exits 1 because of it, ends first.
SLOW_FAILURE = r'''
import atexit, os, time
atexit.register(time.sleep, 60)    # registered first: runs after bps_tf's shutdown
import bps_tf
bps_tf.init()
if os.environ["DMLC_WORKER_ID"] == "1":
    raise ValueError("the data of shard 1 is bad")
bps_tf.shutdown()
'''


def test_the_verdict_names_the_worker_that_failed_first_not_the_server(tmp_path):
    script = tmp_path / "slow_failure.py"
    script.write_text(SLOW_FAILURE)
    env = {k: v for k, v in os.environ.items() if k not in environments.PLACEMENT_VARIABLES}
    proc = subprocess.run([sys.executable, "-m", "bps_tf.launch", "-np", "2", "--timeout",
                           "60", sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=90, cwd=tempfile.gettempdir())
    err = proc.stderr.splitlines()
    # The server went first (the workers were still in their exit handler)...
    assert "[server 0] bps_tf server: the job failed: worker 1 (host " in proc.stderr, err
    assert re.match(r"bpslaunch: job failed \(exit code 1\) after [\d.]+ s: server 0 exit 1 .*"
                    r"worker 1 SIGTERM", err[-1]), err[-3:]
    # ...but the verdict names the cause, with its exception line.
    assert re.fullmatch(r"bpslaunch: worker 1 \(pid \d+\) failed first \(ValueError: the data "
                        r"of shard 1 is bad\); server 0 \(pid \d+\) exited with code 1 after "
                        r"it; stopping the other processes", err[-2]), err[-3:]


# ------------------------------------------------------------- unit level

TRACEBACK = [b"Traceback (most recent call last):", b'  File "x.py", line 3, in <module>',
             b"    f()", b"KeyError: 'a'", b"", b"During handling of the above exception, "
             b"another exception occurred:", b"", b"Traceback (most recent call last):",
             b'  File "x.py", line 5, in <module>', b"    raise ValueError(\"bad\")",
             b"ValueError: bad", b"  second line of its message"]


def test_the_error_watch_keeps_the_first_time_and_the_last_exception_line():
    watch = launch_output.ErrorWatch()
    for line in (b"epoch 1: loss 0.5", b"[12:00:01 WARNING bps_tf worker 0] slow step",
                 b"   Traceback (most recent call last): (quoted, not a traceback)"):
        watch.feed(line)
    assert watch.failed_at is None and watch.error == ""
    watch.feed(TRACEBACK[0])
    first = watch.failed_at
    assert first is not None
    for line in TRACEBACK[1:]:
        watch.feed(line)
    assert watch.failed_at == first and watch.error == "ValueError: bad"
    own = launch_output.ErrorWatch()
    own.feed(b"bps_tf server: the job failed: worker 1 (host h, pid 7) failed (KeyError: 'a')")
    assert own.failed_at is not None
    assert own.error == "bps_tf server: the job failed: worker 1 (host h, pid 7) failed (KeyError: 'a')"
    long = launch_output.ErrorWatch()
    long.feed(TRACEBACK[0])
    long.feed(b"RuntimeError: " + b"word " * 200)
    assert long.error.endswith("word ...") and len(long.error) <= launch_output.MAX_ERROR_CHARS + 4


class _Exited:
    def __init__(self, pid, code):
        self.pid, self.returncode = pid, code

    def poll(self):
        return self.returncode


def _child(name, pid, code=None, failed_at=None, error=""):
    child = procs.Child(name, name.split()[0], _Exited(pid, code))
    child.errors.failed_at, child.errors.error = failed_at, error
    if code is not None:
        child.ended_at = failed_at + 1 if failed_at is not None else 100.0
    return child


def test_the_verdict_blames_the_first_failure_and_the_process_an_error_names():
    job = procs.Job(grace_s=1)
    server = _child("server 0", 10, code=1, failed_at=50.0,
                    error="bps_tf server: the job failed: worker 1 (host h, pid 12) failed (X)")
    w0 = _child("worker 0", 11)
    w1 = _child("worker 1", 12, failed_at=40.0, error="ValueError: bad")
    job.children = [server, w0, w1]
    assert job.verdict(server) == ("worker 1 (pid 12) failed first (ValueError: bad); server 0 "
                                   "(pid 10) exited with code 1 after it; stopping the other "
                                   "processes")
    # Its own lines not read in time: the server's error names the cause by pid.
    w1.errors.failed_at, w1.errors.error = None, ""
    assert job.verdict(server).startswith("worker 1 (pid 12) failed first; server 0 (pid 10) ")
    # A failure of the process itself: its exit and its error line.
    job.children = [w0, _child("worker 1", 12, code=3, failed_at=5.0, error="SystemExit: 3")]
    assert job.verdict(job.children[1], then="") == \
        "worker 1 (pid 12) exited with code 3 (SystemExit: 3)"
    # Nothing in the output: the exit alone, as before.
    quiet = _child("worker 0", 11, code=2)
    job.children = [quiet]
    assert job.verdict(quiet) == "worker 0 (pid 11) exited with code 2; stopping the other processes"

def test_child_env_hides_tensorflow_noise_unless_chosen():
    assert launch_output.child_env({}, {}, piped=True) == {
        "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}
    user = {"TF_CPP_MIN_LOG_LEVEL": "0", "PYTHONUNBUFFERED": ""}
    assert launch_output.child_env(user, user, piped=True) == user
    assert launch_output.child_env({}, {}, piped=False) == {"TF_CPP_MIN_LOG_LEVEL": "2"}


TF_STARTUP = [
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    b"I0000 00:00:1795437200.078561   11944 port.cc:153] oneDNN custom operations are on. "
    b"You may see slightly different numerical results.",
    b"I0000 00:00:1795434898.899314   15359 cpu_feature_guard.cc:227] This TensorFlow binary "
    b"is optimized to use available CPU instructions in performance-critical operations.",
    b"To enable the following instructions: AVX2 FMA, in other operations, rebuild "
    b"TensorFlow with the appropriate compiler flags.",
]


@pytest.mark.parametrize("hide", [True, False])
def test_tensorflow_startup_lines_are_dropped_unless_the_user_chose_a_level(hide, capfdbinary):
    read_fd, write_fd = os.pipe()
    ours = [b"epoch 1: loss 0.5", b"I0000 a line of the user's own that looks similar",
            b"WARNING: a real warning"]
    os.write(write_fd, b"\n".join(TF_STARTUP[:2] + ours[:1] + TF_STARTUP[2:] + ours[1:]) + b"\n")
    os.close(write_fd)
    env = {} if hide else {"TF_CPP_MIN_LOG_LEVEL": "0"}
    assert launch_output.hides_tf_startup(env) == hide
    launch_output.ChildOutput._copy(os.fdopen(read_fd, "rb"), b"[worker 0] ", "stdout",
                                    launch_output.TF_STARTUP_NOISE if hide else None)
    got = capfdbinary.readouterr().out.splitlines()
    kept = ours if hide else TF_STARTUP[:2] + ours[:1] + TF_STARTUP[2:] + ours[1:]
    assert got == [b"[worker 0] " + line for line in kept]


@pytest.mark.parametrize("env, local, expected", [
    ({}, True, "job token generated for this job"),
    ({"BYTEPS_JOB_TOKEN": "s3cr3t"}, False, "job token from BYTEPS_JOB_TOKEN"),
    ({"BYTEPS_JOB_TOKEN": ""}, True, "no job token (BYTEPS_JOB_TOKEN is empty"),
    ({}, False, "no job token (BYTEPS_JOB_TOKEN is not set: connections are neither"),
    ({"BYTEPS_JOB_TOKEN": "s3cr3t", "BYTEPS_ENCRYPTION": "0"}, False,
     "job token from BYTEPS_JOB_TOKEN (BYTEPS_ENCRYPTION=0: connections are not encrypted)"),
    ({"BYTEPS_ENCRYPTION": "off"}, True,
     "job token generated for this job (BYTEPS_ENCRYPTION=0: connections are not encrypted)"),
])
def test_token_source_never_shows_the_token(env, local, expected):
    text = launch_output.token_source(env, local)
    assert text.startswith(expected)
    assert ("not encrypted" in text) == (env.get("BYTEPS_ENCRYPTION") in ("0", "off"))
    assert "s3cr3t" not in text
