"""``BytePSStrategy(elastic=True)``: ``fit``, ``evaluate`` and ``predict``
survive membership changes, and a newcomer lines up with the running
workers wherever their script is (docs/elastic.md).

Each worker numbers its Keras calls under the elastic strategy (a call made
inside another, such as fit's validation, belongs to that one). A call runs
in a loop:

- a membership change fails its pending operation on every survivor; a
  ``fit`` restores its last commit (elastic_fit.py), ``evaluate`` and
  ``predict`` have nothing to roll back; every survivor restarts its
  membership and the call runs again with the new workers;
- after each restart, and at a newcomer's first call, the workers *meet*:
  one sum of a small table in which each says which call it is in (and, in a
  fit, the epoch it committed). The survivor furthest on is the *root*. A
  worker behind it -- a newcomer, which runs its script from the top, or a
  survivor that missed the end of the root's last call -- *replays* its
  earlier calls: each returns, without running, what the job's call returned
  (a fit's History, evaluate's metrics, predict's rows), sent by the root;
  at the root's call it joins the others;
- the first time a model is used in a membership, every worker takes the
  root's values of its variables (and, in a fit, of its optimizer's, with
  the committed epoch and the callbacks' state).

Every decision (meet, replay, sync) depends only on what every worker sees
alike: the membership epoch, the call's number and kind, and the root's
answer; so the workers' collectives pair up without further agreement.
"""
from __future__ import annotations

import logging
import pickle
import threading
import weakref

import numpy as np
import tensorflow as tf

from bps_tf.comm import collectives, elastic_tf, exchange, naming
from bps_tf.runtime import basics, elastic_core, elastic_state
from bps_tf.strategy import choices as strategy_choices
from bps_tf.strategy import phases

log = logging.getLogger("bps_tf")

FIT, EVALUATE, PREDICT = "fit", "evaluate", "predict"
_KINDS = (FIT, EVALUATE, PREDICT)
# The results a newcomer may replay are kept in memory; predictions beyond
# this many bytes in all are not (a replay of one of them is refused).
KEEP_BYTES = 64 << 20
_NOT_KEPT = "not kept"


class ReplayError(RuntimeError):
    """A newcomer cannot replay a call the job made before it joined."""


class _Job:
    """This process's place in the elastic program."""

    def __init__(self):
        self.calls = 0                     # Keras calls begun (their numbers)
        self.results = {}                  # number -> (kind, result) of calls ended
        self.kept = 0                      # bytes of predictions kept
        self.target = 0                    # calls numbered below it are replayed
        self.root = 0                      # whose state this membership syncs from
        self.met = None                    # membership epoch of the last meeting
        self.syncs = (None, 0)             # (membership epoch, syncs begun in it)
        self.synced = weakref.WeakKeyDictionary()   # model -> {"model": e, "optimizer": (e, id)}
        self.models = weakref.WeakSet()    # models whose traced functions a restart drops
        self.local = threading.local()     # depth of nested calls


_job = _Job()


def nested() -> bool:
    """True inside an elastic call (fit's validation, a callback's predict)."""
    return getattr(_job.local, "depth", 0) > 0


def run(kind, model, strategy, attempt, fit_state=None, keep=True):
    """Runs one Keras call elastically; ``attempt()`` runs it once (the
    phase check and Keras' own call) and returns its result. ``fit_state``
    (elastic_fit.FitState) is a fit's committed state. ``keep``: the result
    is the same on every worker, so a newcomer may replay it."""
    _job.models.add(model)
    if nested():
        return attempt()
    _check_built(model, kind)
    number = _job.calls
    _job.calls += 1
    _job.local.depth = 1
    try:
        return _loop(kind, number, model, strategy, attempt, fit_state, keep)
    finally:
        _job.local.depth = 0


def _loop(kind, number, model, strategy, attempt, fit_state, keep):
    meet = _job.met is None and elastic_core.epoch() > 0   # a newcomer's first call
    if _job.met is None and not meet:
        _job.met = 0   # one of the workers the job started with
    while True:
        try:
            if meet:
                _meet(kind, number, fit_state)
                meet = False
            if number < _job.target:
                return _replay(kind, number, model)
            _sync(kind, model, fit_state)
            result = attempt()
            _record(kind, number, result if keep else None)
            return result
        except elastic_state.HostsUpdatedInterrupt:
            # Raised by a commit: restoring it changes nothing, unless a
            # callback of the user's checked for newcomers mid-epoch.
            if fit_state is not None:
                fit_state.restore()
            log.warning("elastic %s: workers wait to join; going on with them", kind)
        except Exception as exc:  # pylint: disable=broad-except
            if not (isinstance(exc, elastic_state.HorovodInternalError) or elastic_core.changed()):
                raise
            if fit_state is not None:
                fit_state.restore()
            log.warning("elastic %s: the workers changed; %s (%s)", kind,
                        f"back to the commit of epoch {fit_state.epoch}" if fit_state else
                        "running it again with the new workers",
                        " ".join(str(exc).split())[:200])
        restart(strategy)
        meet = True


def restart(strategy) -> None:
    """Leaves this membership and joins the next one; the strategy takes the
    new worker count and rank, traced functions are dropped."""
    elastic_tf.reset()
    phases.restart_count()
    refresh(strategy)
    for model in list(_job.models):
        for attr in ("train_function", "test_function", "predict_function"):
            if hasattr(model, attr):
                setattr(model, attr, None)
    log.warning("elastic: rank %d of %d, %d replicas in sync", basics.rank(), basics.size(),
                strategy.num_replicas_in_sync)


def refresh(strategy) -> None:
    """The strategy takes the new membership: worker count, rank, and the
    choices every worker must share (agreed again, with any newcomer)."""
    strategy.extended.bps_follow_membership()
    strategy._bps_cluster_resolver = None      # pylint: disable=protected-access
    strategy.overlap, early = strategy_choices.agreed(False, False,
                                                      len(strategy.extended.worker_devices))
    strategy.extended.bps_early_data_check = early and strategy.num_workers > 1


# ----------------------------------------------------------------- meeting

_COLUMNS = 5   # call number, kind, committed epoch, newcomer, fit begun


def _meet(kind, number, fit_state) -> None:
    """Every worker says where it is; the survivor furthest on becomes the
    root, and those behind it learn what its calls returned."""
    size, rank = basics.size(), basics.rank()
    newcomer = _job.met is None
    epoch = fit_state.epoch if fit_state is not None else 0
    begun = int(bool(fit_state is not None and fit_state.begun))
    mine = np.array([[number, _KINDS.index(kind), epoch, int(newcomer), begun]], np.int64)
    table = tf.scatter_nd([[rank]], tf.constant(mine), [size, _COLUMNS])
    rows = collectives.push_pull_sum(table, naming.strategy_key("elastic", "position"),
                                     collectives.BLOCKING_PRIORITY).numpy()
    members = [r for r in range(size) if not rows[r][3]] or list(range(size))
    root = max(members, key=lambda r: (rows[r][0], rows[r][2], -r))
    target = int(rows[root][0])
    lowest = int(min(rows[:, 0]))
    if lowest < target:
        wanted = {i: _job.results.get(i) for i in range(lowest, target)} if rank == root else None
        _job.results.update(exchange.broadcast_object(
            wanted, root_rank=root, name=naming.strategy_key("elastic", "results")))
    _job.target, _job.root, _job.met = target, root, elastic_core.epoch()
    if number < target:
        log.warning("elastic: this worker is at %s call %d, the job at call %d (%s%s, rank %d's): "
                    "the calls before it are replayed from the job's results", kind, number + 1,
                    target + 1, _KINDS[int(rows[root][1])],
                    f", epoch {int(rows[root][2]) + 1}" if rows[root][1] == 0 else "", root)


def _record(kind, number, result) -> None:
    if kind == FIT:
        history = result
        kept = {"epoch": list(getattr(history, "epoch", [])),
                "history": dict(getattr(history, "history", {})),
                "params": dict(getattr(history, "params", None) or {})}
    elif kind == PREDICT or result is None:
        size = None if result is None else sum(np.asarray(a).nbytes
                                               for a in tf.nest.flatten(result))
        if size is None or _job.kept + size > KEEP_BYTES:
            kept = _NOT_KEPT
        else:
            _job.kept += size
            kept = tf.nest.map_structure(np.asarray, result)
    else:
        kept = result
        try:
            pickle.dumps(kept)
        except Exception:  # pylint: disable=broad-except
            kept = _NOT_KEPT
    _job.results[number] = (kind, kept)


def _replay(kind, number, model):
    """What the job's call ``number`` returned, for a worker that joins
    later in the script (nothing runs; the model gets the root's weights at
    the call it joins)."""
    found = _job.results.get(number)
    if found is None or found[0] != kind:
        raise ReplayError(
            f"BytePSStrategy(elastic=True): this worker joined the job at Keras call "
            f"{_job.target + 1}, and its call {number + 1} is a {kind} where the job's was "
            f"{'unknown' if found is None else 'a ' + found[0]}: every worker must run the same "
            f"script, calling fit/evaluate/predict in the same order.")
    value = found[1]
    if isinstance(value, str) and value == _NOT_KEPT:
        raise ReplayError(
            f"BytePSStrategy(elastic=True): this worker joined the job later in the script and "
            f"cannot replay its {kind} call {number + 1}: the job did not keep its result "
            f"(predictions beyond {KEEP_BYTES >> 20} MiB in all, or of a dataset, which each "
            f"worker predicts its own shard of). Call predict after training, or on arrays.")
    log.info("elastic: %s call %d replayed (the job made it before this worker joined)",
             kind, number + 1)
    if kind != FIT:
        return value
    import keras
    history = keras.callbacks.History()
    history.set_model(model)
    history.epoch, history.history = list(value["epoch"]), dict(value["history"])
    history.params = dict(value["params"])
    model.history = history
    return history


# -------------------------------------------------------------------- sync

def _sync(kind, model, fit_state) -> None:
    """The root's values of ``model`` (and, in a fit, of its optimizer and
    the fit's committed state), the first time the model is used in this
    membership."""
    epoch = elastic_core.epoch()
    marks = _job.synced.setdefault(model, {})
    optimizer = getattr(model, "optimizer", None) if kind == FIT else None
    wanted = marks.get("model") != epoch
    if optimizer is not None:
        wanted = wanted or marks.get("optimizer") != (epoch, id(optimizer))
    base = None
    if wanted and basics.size() > 1:
        base = _next_sync_key()
        _broadcast(list(model.variables) + (naming.optimizer_variables(optimizer)
                                            if optimizer is not None else []), _job.root, base)
    if fit_state is not None:
        fit_state.synced(None if base is None else _job.root, f"{base}/state")
    if wanted:
        marks["model"] = epoch
        if optimizer is not None:
            marks["optimizer"] = (epoch, id(optimizer))


def _next_sync_key() -> str:
    """The key of this membership's next sync: syncs happen in the same
    order on every worker, and each may carry other shapes."""
    epoch = elastic_core.epoch()
    count = _job.syncs[1] if _job.syncs[0] == epoch else 0
    _job.syncs = (epoch, count + 1)
    return naming.strategy_key("elastic", "sync", count)


def _broadcast(variables, root, base) -> None:
    """Assigns ``root``'s values to ``variables`` (matched by position: every
    worker built the same model; Keras numbers layer names per process)."""
    seen, unique = set(), []
    for v in variables:
        if id(v) not in seen and getattr(v, "synchronization", None) != "on_read":
            seen.add(id(v))
            unique.append(v)

    @tf.function(autograph=False)
    def assign_all():
        for i, v in enumerate(unique):
            v.assign(collectives.broadcast(tf.convert_to_tensor(v), f"{base}/{i}", root))
    if unique:
        assign_all()


def _check_built(model, kind) -> None:
    if not getattr(model, "built", True):
        raise ValueError(
            f"BytePSStrategy(elastic=True): build the model before {kind}() (give it a "
            f"keras.Input, or call model.build(input_shape)): its weights must exist when the "
            f"call begins, so that a worker joining later receives them.")
