"""Horovod's process sets, as far as a parameter-server job can honour them.

Every bps_tf collective runs over all workers: the servers wait for every
worker's part of a tensor. So the one process set is the global one.
Horovod code that passes ``process_set=hvd.global_process_set`` (or queries
it) runs unchanged; asking for a subset of ranks is an error that says so,
never a collective that silently runs over everyone.

No TensorFlow here.
"""
from __future__ import annotations

from typing import Optional, Sequence

from bps_tf import basics

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
           "check_process_set"]


class ProcessSet:
    """A set of ranks. ``ranks=None`` (the global set) means every worker."""

    def __init__(self, ranks: Optional[Sequence[int]] = None):
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id = 0 if ranks is None else None

    def is_global(self) -> bool:
        return self.ranks is None or (basics.is_initialized()
                                      and self.ranks == list(range(basics.size())))

    def size(self) -> int:
        return basics.size() if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        return basics.rank() if self.ranks is None else self.ranks.index(basics.rank())

    def included(self) -> bool:
        return self.ranks is None or basics.rank() in self.ranks

    def __repr__(self):
        return "ProcessSet(global)" if self.ranks is None else f"ProcessSet({self.ranks})"


global_process_set = ProcessSet()


def _refuse(what: str):
    raise NotImplementedError(
        f"{what}: bps_tf runs every collective over all workers (the parameter servers "
        "wait for every worker), so process sets other than the global one are not "
        "available; use process_set=global_process_set (the default).")


def add_process_set(process_set):
    """Refused unless it names every rank (then it is the global set)."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if not ps.is_global(): 
        _refuse(f"add_process_set({ps.ranks})")
    return global_process_set


def remove_process_set(process_set) -> bool:
    """Horovod returns whether it was removed; the global set never is."""
    del process_set
    return False


def check_process_set(process_set, what: str) -> None:
    """Raises unless ``process_set`` is the global set (or None)."""
    if process_set is None or process_set is global_process_set:
        return
    if isinstance(process_set, ProcessSet) and process_set.is_global():
        return
    _refuse(f"{what}(process_set={process_set!r})")
