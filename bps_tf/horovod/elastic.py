"""Horovod's elastic API (``hvd.elastic``): state objects and ``run``.

``TensorFlowState(variables, **attrs)`` and ``TensorFlowKerasState(model,
optimizer, **attrs)`` (``KerasState``) keep a copy of the variables (and of
plain attributes such as ``batch`` and ``epoch``); ``ObjectState(**attrs)``
only the attributes. ``commit()`` takes a new copy and checks for workers
waiting to join, ``restore()`` puts the last copy back, ``sync()`` gives
every worker rank 0's values (then takes a copy).

``run(func)`` makes ``func(state, ...)`` elastic under ``BYTEPS_ELASTIC=1``
(``bpslaunch --min-np/--max-np``, docs/elastic.md): when the workers change
(a worker was lost, or failed), every survivor's pending operation fails with
``WorkersChangedError`` (a ``HorovodInternalError``); ``run`` restores the
last commit, restarts the worker's membership (dense ranks, the survivors in
the order of their old ranks, the new ``size()``), syncs the state from the
new rank 0 and calls ``func`` again. When workers wait to join, the next
``commit()`` raises ``HostsUpdatedInterrupt`` on every worker at the same
step; ``run`` then restarts the membership keeping the state just
committed, and the newcomers receive it through ``sync()``. Without
``BYTEPS_ELASTIC=1`` ``run`` syncs and calls ``func`` once: a lost worker
fails the job, as it always does.

The classes live in bps_tf.comm.elastic_tf (TensorFlow objects) and
bps_tf.runtime.elastic_state (the rest), shared with BytePSStrategy's
elastic Keras calls.
"""
from __future__ import annotations

from bps_tf.comm.elastic_tf import (KerasState, TensorFlowKerasState,  # noqa: F401
                                    TensorFlowState, reset, run)
from bps_tf.runtime.elastic_state import (HorovodInternalError,  # noqa: F401
                                          HostsUpdatedInterrupt, HostUpdateResult,
                                          ObjectState, State, WorkersChangedError)

__all__ = ["ObjectState", "State", "TensorFlowState", "TensorFlowKerasState", "KerasState",
           "HorovodInternalError", "HostsUpdatedInterrupt", "HostUpdateResult",
           "WorkersChangedError", "run"]
