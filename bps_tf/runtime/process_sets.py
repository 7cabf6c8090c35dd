"""Horovod's process sets: collectives among a subset of the workers.

A set is registered on every worker by :func:`add_process_set` (a
collective over all workers, called in the same order everywhere, so a
set has the same ``process_set_id`` on every worker). A collective given
``process_set=`` carries the set's ranks in its agreement text
(``set=0,2``, bps_tf.comm.collectives.agreement_scope): the scheduler then waits
for those ranks' declarations only, and the servers complete a round when
those ranks have pushed (the push header's ``contributors``). Within a set,
size and rank are the set's (allgather order, the average's divisor);
a broadcast's ``root_rank`` is a global rank, as in Horovod. A worker
outside the set that calls a collective with it fails at once; the
gradient wrappers instead leave its gradients unchanged (``reduces_over``).
Ids are Horovod's (a removed set's id goes to the next set added); tensor
keys use ``key_id``, which is never reused.

No TensorFlow here.
"""
from __future__ import annotations

import itertools
import sys
import threading
from typing import Dict, List, Optional, Sequence

import numpy as np

from bps_tf.runtime import basics

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
           "check_process_set", "resolve", "reduces_over", "process_set_by_id", "ids_and_ranks",
           "set_agreement",
           "reset_registry", "register_at_init"]

# How long add_process_set waits for every worker to register the set.
REGISTER_TIMEOUT_S = 120.0


class ProcessSet:
    """A set of ranks; ``ranks=None`` (the global set) means every worker.
    Usable once registered by :func:`add_process_set` (the global one always is)."""

    def __init__(self, ranks_or_comm: Optional[Sequence[int]] = None):
        if ranks_or_comm is not None and not isinstance(ranks_or_comm, (list, tuple, range)):
            raise TypeError("ProcessSet takes a list of ranks (MPI communicators are not "
                            f"available in bps_tf), got {type(ranks_or_comm).__name__}.")
        self.ranks = None if ranks_or_comm is None else sorted(int(r) for r in ranks_or_comm)
        if self.ranks is not None and len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"ProcessSet ranks {list(ranks_or_comm)} repeat a rank.")
        self.process_set_id = 0 if ranks_or_comm is None else None
        # Names this registration's tensors: never reused, unlike
        # process_set_id (Horovod hands a removed set's id to the next one).
        self.key_id = 0 if ranks_or_comm is None else None

    def _ranks(self) -> List[int]:
        return list(range(basics.size())) if self.ranks is None else self.ranks

    def size(self) -> Optional[int]:
        """Number of ranks in the set (None until registered)."""
        if self.process_set_id is None:
            return None
        return basics.size() if self.ranks is None else len(self.ranks)

    def rank(self) -> Optional[int]:
        """This worker's rank within the set, -1 outside it (None until
        registered). Collectives still take global ranks as ``root_rank``."""
        if self.process_set_id is None:
            return None
        return self._ranks().index(basics.rank()) if self.included() else -1

    def included(self) -> Optional[bool]:
        """Whether this worker belongs to the set (None until registered)."""
        if self.process_set_id is None:
            return None
        return self.ranks is None or basics.rank() in self.ranks

    def __eq__(self, other):
        return isinstance(other, ProcessSet) and self.ranks == other.ranks

    def __hash__(self):
        return hash(None if self.ranks is None else tuple(self.ranks))

    def __repr__(self):
        # Horovod's format; the global set lists every rank once initialized.
        ranks = self.ranks
        if ranks is None and basics.is_initialized():
            ranks = self._ranks()
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={ranks}, mpi_comm=None)"


global_process_set = ProcessSet()

_lock = threading.Lock()
_registered: Dict[int, ProcessSet] = {0: global_process_set}
_next_key = itertools.count(1)
_add_calls = itertools.count()


def reset_registry() -> None:
    """Forgets every registered set but the global one (a new job after shutdown)."""
    global _next_key, _add_calls
    with _lock:
        for ps in list(_registered.values()):
            if ps is not global_process_set:
                ps.process_set_id = ps.key_id = None
        _registered.clear()
        _registered[0] = global_process_set
        _next_key = itertools.count(1)
        _add_calls = itertools.count()


def add_process_set(process_set) -> ProcessSet:
    """Registers ``process_set`` (a ProcessSet or a list of ranks) on every
    worker and returns it with its ``process_set_id``.

    A collective over all workers: each must call it with the same ranks, in
    the same order relative to other add_process_set calls; workers that
    pass different ranks all fail, naming both lists. A set with the same
    ranks as a registered one (the global set included) is a ValueError, as
    in Horovod.
    """
    if not basics.is_initialized():
        raise basics.NotInitializedError("add_process_set: call bps_tf.init() first.")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.ranks is None:
        raise ValueError("add_process_set needs a list of ranks (the global set is "
                         "always registered).")
    if ps.process_set_id is not None:
        raise ValueError(f"{ps!r} is registered already.")
    size = basics.size()
    if not ps.ranks or ps.ranks[0] < 0 or ps.ranks[-1] >= size:
        raise ValueError(f"add_process_set({ps.ranks}): ranks must be in [0, {size}) and "
                         "the set not empty.")
    with _lock:
        for known in _registered.values():
            if known._ranks() == ps.ranks:  # pylint: disable=protected-access
                raise ValueError(f"a process set with ranks {ps.ranks} exists already: "
                                 f"{known!r}.")
        call = next(_add_calls)
    ranks = ",".join(str(r) for r in ps.ranks)
    # One tiny sum over all workers whose agreement is the ranks: a worker
    # that registers other ranks makes every worker fail at once.
    if size > 1:
        zero = np.zeros([1], np.int32)
        handle = basics.core().push_pull_async(f"ProcessSets/add.{call}", zero, zero.copy(),
                                               agreement=f"ranks={ranks}")
        try:
            handle.wait(REGISTER_TIMEOUT_S)
        except Exception as e:  # the core's message names both lists
            raise ValueError(f"add_process_set({ps.ranks}) failed: {e}") from e
    with _lock:
        # The lowest free id, as in Horovod: the same on every worker as
        # long as every worker adds and removes sets in the same order.
        ps.process_set_id = next(i for i in itertools.count(1) if i not in _registered)
        ps.key_id = next(_next_key)
        _registered[ps.process_set_id] = ps
    return ps


def register_at_init(process_sets) -> None:
    """``init(process_sets=[...])``: a fresh registry holding these sets
    (ProcessSet objects or lists of ranks), registered in list order."""
    reset_registry()
    if isinstance(process_sets, str) and process_sets == "dynamic":
        return   # Horovod's switch for add_process_set later: always on here
    for ps in process_sets or ():
        add_process_set(ps)


def remove_process_set(process_set) -> bool:
    """Unregisters ``process_set`` on this worker; returns whether it was
    registered (the global set never is removed). Call it on every worker."""
    if not isinstance(process_set, ProcessSet) or process_set is global_process_set:
        return False
    with _lock:
        if _registered.get(process_set.process_set_id) is not process_set:
            return False
        del _registered[process_set.process_set_id]
        process_set.process_set_id = process_set.key_id = None
    return True


def ids_and_ranks() -> Dict[int, List[int]]:
    """{process_set_id: ranks} of every registered set, the global one included."""
    with _lock:
        return {pid: ps._ranks() for pid, ps in sorted(_registered.items())}  # pylint: disable=protected-access


def process_set_by_id(process_set_id: int) -> ProcessSet:
    """The registered set with ``process_set_id``; a ValueError if none."""
    with _lock:
        ps = _registered.get(int(process_set_id))
    if ps is None:
        raise ValueError(f"no process set has process_set_id={process_set_id} on this worker "
                         "(add_process_set registers one).")
    return ps


def resolve(process_set, what: str, members_only: bool = True) -> ProcessSet:
    """The registered set a collective runs over (the global one for None).
    Raises unless it is registered and (``members_only``) this worker
    belongs to it: a TypeError, a ValueError, or for a non-member the
    error of :func:`_not_member`."""
    if process_set is None or process_set is global_process_set:
        return global_process_set
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{what}: process_set must be a ProcessSet, got "
                        f"{type(process_set).__name__}.")
    if process_set.process_set_id is None or \
            _registered.get(process_set.process_set_id) is not process_set:
        raise ValueError(f"{what}: {process_set!r} is not registered; call "
                         "add_process_set on every worker first.")
    if members_only and basics.is_initialized() and not process_set.included():
        raise _not_member(f"{what}: this worker (rank {basics.rank()}) is not in "
                          f"{process_set!r}; only its members may call collectives with it.")
    return process_set


def reduces_over(process_set: ProcessSet) -> bool:
    """Whether the gradient wrappers (tape, optimizers) reduce over the set.
    As in Horovod, a worker outside a set, or alone in it, keeps its own
    gradients unchanged (no exchange, no scaling); the global set always
    reduces."""
    if process_set.ranks is None:
        return True
    return bool(process_set.included()) and len(process_set.ranks) > 1


_not_member_class = None


def _not_member(message: str) -> Exception:
    """Horovod raises tf.errors.InvalidArgumentError for a collective over a
    set the rank is not in; earlier bps_tf raised ValueError. The error is
    both when TensorFlow is loaded (always, for a collective), else a
    ValueError: this module imports no TensorFlow."""
    global _not_member_class
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return ValueError(message)
    if _not_member_class is None:
        class NotInProcessSetError(tf.errors.InvalidArgumentError, ValueError):
            def __init__(self, text):
                tf.errors.InvalidArgumentError.__init__(self, None, None, text)
        _not_member_class = NotInProcessSetError
    return _not_member_class(message)


def set_agreement(process_set: ProcessSet) -> str:
    """The ``set`` term of a collective's agreement: "" for the global set."""
    if process_set.ranks is None:
        return ""
    return ",".join(str(r) for r in process_set.ranks)


def check_process_set(process_set, what: str) -> None:
    """Raises unless ``process_set`` is the global set (or None): for the
    calls that cannot run over a subset of workers."""
    if process_set is None or process_set is global_process_set:
        return
    raise NotImplementedError(f"{what}(process_set={process_set!r}): only the global "
                              "process set is available here.")
