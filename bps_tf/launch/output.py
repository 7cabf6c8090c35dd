"""What bpslaunch prints: its own lines, and its children's output, prefixed.

With prefixing on, each child's stdout and stderr come through pipes; one
thread per pipe cuts what arrives into whole lines and writes them, each led by
``[worker 1] ``-style tags, to the launcher's own stdout or stderr. Every write
of whole lines (and of the launcher's own messages) happens under one lock,
so the lines of two processes never mix within a line. Bytes are passed on as
they are: output that is not UTF-8 is neither decoded nor lost.

No TensorFlow here.
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time
from typing import Iterable, List, Mapping, Optional

from bps_tf.runtime import config, messages

PROG = "bpslaunch"

# Output that never ends a line is still shown once this much has piled up.
MAX_PENDING_BYTES = 1 << 20
READ_BYTES = 65536

_LOCK = threading.Lock()


def _write(stream, data: bytes) -> None:
    raw = getattr(stream, "buffer", None)
    try:
        if raw is not None:
            stream.flush()        # text written through the text layer goes first
            raw.write(data)
            raw.flush()
        else:
            stream.write(data.decode("utf-8", errors="replace"))
            stream.flush()
    except (OSError, ValueError):
        pass                      # a closed terminal must not stop the job


def write_lines(target: str, data: bytes) -> None:
    """Write whole lines to sys.stdout or sys.stderr (``target``), under the lock."""
    with _LOCK:
        _write(getattr(sys, target), data)


def say(message: str) -> None:
    """A launcher line on stderr; it always reaches the user, whatever the log level."""
    write_lines("stderr", f"{PROG}: {message}\n".encode("utf-8", errors="replace"))


def prefixed(prefix: bytes, lines: Iterable[bytes]) -> bytes:
    return b"".join(prefix + line + b"\n" for line in lines)


# TensorFlow 2.21 prints these at start-up from every process whatever
# TF_CPP_MIN_LOG_LEVEL says (they come before its logging is set up).
TF_STARTUP_NOISE = re.compile(
    rb"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    rb"|I0000 [0-9:. ]+ +\d+ (port|cpu_feature_guard)\.cc:\d+\] .*"
    rb"|To enable the following instructions: .*in other operations, rebuild TensorFlow.*)$")


def hides_tf_startup(user_env: Mapping[str, str]) -> bool:
    """TensorFlow's start-up lines are hidden unless the user chose a TF log level."""
    return "TF_CPP_MIN_LOG_LEVEL" not in user_env


TRACEBACK = b"Traceback (most recent call last):"
# Lines inside a traceback that are not its exception line: frames and code
# (indented), the separators of chained exceptions, blank lines.
_NOT_EXCEPTION = re.compile(rb"^(\s|$|During handling of the above exception|"
                            rb"The above exception was the direct cause)")
# bps_tf's own one-line failures: a server's or scheduler's last words, a
# node's refusal to start (bps_tf/runtime/server.py, runtime/security.py).
OWN_FAILURE = re.compile(rb"^bps_tf (server|scheduler|worker)( \d+)?: ")
MAX_ERROR_CHARS = 500


class ErrorWatch:
    """What one child's output says about its failure, for the launcher's verdict.

    ``failed_at``: when (time.monotonic) it first showed an error, a Python
    traceback or one of bps_tf's failure lines, which may be long before it
    exits (TensorFlow's teardown takes seconds); ``error``: its last error
    line, the exception line of its last traceback ("ValueError: ...").
    Fed whole lines by the thread that copies the child's pipe.
    """

    def __init__(self) -> None:
        self.failed_at: Optional[float] = None
        self.error = ""
        self._in_traceback = False

    def feed(self, line: bytes) -> None:
        if line.startswith(TRACEBACK):
            self._in_traceback = True
            self._fail()
        elif self._in_traceback:
            if not _NOT_EXCEPTION.match(line):
                self._in_traceback = False
                self._set_error(line)
        elif OWN_FAILURE.match(line):
            self._fail()
            self._set_error(line)

    def _fail(self) -> None:
        if self.failed_at is None:
            self.failed_at = time.monotonic()

    def _set_error(self, line: bytes) -> None:
        self.error = messages.one_line(line.decode("utf-8", errors="replace"), MAX_ERROR_CHARS)


class ChildOutput:
    """Copies children's stdout/stderr to ours, every line tagged with the child's name.

    With ``hide_tf_startup``, TensorFlow's start-up lines (the same on every
    worker, and not silenced by TF_CPP_MIN_LOG_LEVEL) are dropped. Each
    child's lines also go to its ErrorWatch.
    """

    def __init__(self, hide_tf_startup: bool = False) -> None:
        self._threads: List[threading.Thread] = []
        self._by_pid: dict = {}
        self._noise = TF_STARTUP_NOISE if hide_tf_startup else None

    def attach(self, name: str, popen, watch: Optional[ErrorWatch] = None) -> None:
        """Start copying the pipes of ``popen`` (made with stdout=PIPE, stderr=PIPE)."""
        prefix = f"[{name}] ".encode("utf-8")
        for pipe, target in ((popen.stdout, "stdout"), (popen.stderr, "stderr")):
            if pipe is None:
                continue
            thread = threading.Thread(target=self._copy,
                                      args=(pipe, prefix, target, self._noise, watch),
                                      name=f"{PROG} {name} {target}", daemon=True)
            thread.start()
            self._threads.append(thread)
            self._by_pid.setdefault(popen.pid, []).append(thread)

    def drain(self, pid: int, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until an exited child's last lines are read."""
        give_up = time.monotonic() + timeout_s
        for thread in self._by_pid.get(pid, []):
            thread.join(max(0.0, give_up - time.monotonic()))

    @staticmethod
    def _copy(pipe, prefix: bytes, target: str, noise=None,
              watch: Optional[ErrorWatch] = None) -> None:
        fd = pipe.fileno()
        pending = b""
        try:
            while True:
                try:
                    chunk = os.read(fd, READ_BYTES)
                except OSError:
                    break
                if not chunk:
                    break
                pending += chunk
                if b"\n" in chunk:
                    *lines, pending = pending.split(b"\n")
                    if noise is not None:
                        lines = [ln for ln in lines if not noise.match(ln)]
                    if watch is not None:
                        for line in lines:
                            watch.feed(line)
                    if lines:
                        write_lines(target, prefixed(prefix, lines))
                if len(pending) >= MAX_PENDING_BYTES:
                    write_lines(target, prefixed(prefix, [pending]))
                    pending = b""
            if pending:            # a last line without its newline
                if watch is not None:
                    watch.feed(pending)
                write_lines(target, prefixed(prefix, [pending]))
        finally:
            pipe.close()

    def wait(self, timeout_s: float = 5.0) -> None:
        """Wait until every pipe reached its end (the children and theirs exited)."""
        give_up = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, give_up - time.monotonic()))


def child_env(env: Mapping[str, str], user_env: Mapping[str, str], piped: bool) -> dict:
    """The environment a child starts with, given what the user set.

    TensorFlow's C++ start-up lines (repeated by every worker) are hidden
    unless the user chose a TF_CPP_MIN_LOG_LEVEL; a piped Python child must
    not hold its output back in a buffer.
    """
    result = dict(env)
    if hides_tf_startup(user_env):
        result["TF_CPP_MIN_LOG_LEVEL"] = "2"
    if piped:
        result.setdefault("PYTHONUNBUFFERED", "1")
    return result


def token_source(user_env: Mapping[str, str], local: bool) -> str:
    """Where the job token comes from, for the start line; never the token."""
    clear = "connections are neither authenticated nor encrypted"
    if "BYTEPS_JOB_TOKEN" in user_env:
        if user_env["BYTEPS_JOB_TOKEN"]:
            return "job token from BYTEPS_JOB_TOKEN" + _unencrypted(user_env)
        return f"no job token (BYTEPS_JOB_TOKEN is empty: {clear})"
    if local:
        return "job token generated for this job" + _unencrypted(user_env)
    return f"no job token (BYTEPS_JOB_TOKEN is not set: {clear})"


def _unencrypted(user_env: Mapping[str, str]) -> str:
    try:
        on = config.value("BYTEPS_ENCRYPTION", user_env)
    except ValueError:
        return ""  # every process refuses the value with its own clear error
    return "" if on else " (BYTEPS_ENCRYPTION=0: connections are not encrypted)"


def end_line(children, code: int, elapsed_s: float) -> str:
    """``finished in 3.2 s: worker 0 exit 0 (3.0 s), ...`` for the launcher's last line."""
    outcome = "job finished" if code == 0 else f"job failed (exit code {code})"
    parts = [child.summary() for child in children]
    return f"{outcome} after {elapsed_s:.1f} s" + (": " + ", ".join(parts) if parts else "")


def plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def health_ports(base: Optional[int], num_servers: int) -> str:
    if not base:
        return ""
    if num_servers == 1:
        return f", gRPC health on port {base}"
    return f", gRPC health on ports {base}-{base + num_servers - 1}"
