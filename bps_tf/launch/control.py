"""bpslaunch's link to the scheduler of an elastic local job (docs/elastic.md).

Over it the launcher reports what it sees and does at once, instead of
leaving the scheduler to notice by heartbeats (``BYTEPS_TIMEOUT``): a
worker process that ended (``lost``, with the workers removed because of
it), workers removed from the job (``remove``: their host left the
discovery script's list or was blacklisted), newcomers it started
(``announce``). It hears each membership's members, the workers that leave
or left, and the job's end or failure.

The link is the core's (bps_tf._core.LauncherLink: loaded without
TensorFlow), authenticated and sealed with the job token like every other
connection of the job. Without it (a core that does not load) the job still
runs, only slower to notice a lost worker.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional

from bps_tf.launch.output import say
from bps_tf.launch.procs import LOG
from bps_tf.runtime import config, security


def _escape(text: str) -> str:
    # The core's config text (common.cc Escape): one line per key.
    return str(text).replace("%", "%25").replace("\n", "%0A")


def _unescape(text: str) -> str:
    return text.replace("%0A", "\n").replace("%25", "%")


def encode(fields: Mapping[str, str]) -> str:
    return "".join(f"{k}={_escape(v)}\n" for k, v in fields.items())


def decode(text: str) -> Dict[str, str]:
    found = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            found[key] = _unescape(value)
    return found


class SchedulerLink:
    """The launcher's end; every method is safe to call when the link failed."""

    def __init__(self, port: int, environ: Mapping[str, str], host: str = ""):
        # The scheduler listens where the job's processes reach it (--address).
        host = host or environ.get("DMLC_PS_ROOT_URI") or "127.0.0.1"
        self._link = None
        try:
            from bps_tf.runtime.loader import load_core
            values = security.core_values(config.value("BYTEPS_JOB_TOKEN", environ),
                                          config.value("BYTEPS_ENCRYPTION", environ))
            values.update(scheduler_host=host, scheduler_port=str(port))
            self._link = load_core().LauncherLink(config.to_core_text(values))
        except (ImportError, RuntimeError, ValueError, AttributeError) as exc:
            say(f"elastic: no link to the scheduler ({exc}); a lost worker is noticed after "
                f"BYTEPS_TIMEOUT instead of at once")

    def send(self, **fields: str) -> None:
        if self._link is None:
            return
        text = encode({k: v for k, v in fields.items() if v != ""})
        LOG.info("to the scheduler: %s", text.strip().replace("\n", "; "))
        self._link.send(text)

    def lost(self, launch_id: str, why: str, removed: Iterable[str] = (),
             removed_why: str = "") -> None:
        self.send(lost=launch_id, lost_why=why, remove=",".join(removed), why=removed_why)

    def remove(self, launch_ids: Iterable[str], why: str) -> None:
        ids = ",".join(launch_ids)
        if ids:
            self.send(remove=ids, why=why)

    def announce(self, launch_ids: Iterable[str]) -> None:
        ids = ",".join(launch_ids)
        if ids:
            self.send(announce=ids)

    def receive(self, timeout_ms: int = 0) -> List[Dict[str, str]]:
        if self._link is None:
            return []
        return [decode(text) for text in self._link.receive(timeout_ms)]

    def refusal(self) -> Optional[str]:
        return self._link.refusal() if self._link is not None else None

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None
