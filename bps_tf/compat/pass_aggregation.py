"""``backward_passes_per_step > 1`` for tf_keras (Keras 2) and TF1 optimizers.

Keras 3 optimizers accumulate on their own (``gradient_accumulation_steps``);
tf_keras ones do not, so the tf_keras wrapper sums each batch's gradients
into local variables and, on every ``passes``-th call of
``apply_gradients``, reduces the sum across workers once and applies it:
workers exchange gradients once per ``passes`` batches, as in Horovod. The
other calls only advance ``optimizer.iterations``, so learning-rate
schedules and checkpoints count batches the same way with and without
aggregation.

The sums are summed, not averaged, over the passes unless
``average_aggregated_gradients=True`` (Horovod's default and meaning).
Sparse gradients are summed densely: an ``IndexedSlices`` per batch cannot
be added in place.

The wrapper keeps this object as ``_agg_helper`` with a ``counter``
variable (batches summed since the last exchange), the names Horovod's
Keras tests read.

A TF1 optimizer (``bps_tf.compat.v1.DistributedOptimizer``) splits the step
in two calls: ``reduce`` (in ``compute_gradients``) sums and, on the
passes-th batch, reduces; ``ready`` (in ``apply_gradients``) says whether
the last ``reduce`` exchanged, so the update is applied only then. Its
variables go in TF1's ``LOCAL_VARIABLES`` (run
``local_variables_initializer``, as with Horovod; a checkpoint leaves them
out).
"""
from __future__ import annotations

import tensorflow as tf


def passes_count(backward_passes_per_step) -> int:
    """``backward_passes_per_step`` as an int >= 1; anything else (0, 1.5,
    "2") is refused rather than rounded to some other number of passes."""
    value = backward_passes_per_step
    if isinstance(value, bool) or not float(value).is_integer() or int(value) < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {value!r}.")
    return int(value)


def _make_variable(make_initial, name, graph_local):
    """A non-trainable variable holding ``make_initial()``, made outside any
    function being traced (so a retrace never makes variables); in a TF1
    graph a LOCAL_VARIABLES one when ``graph_local``."""
    with tf.init_scope():
        initial = make_initial()
        if tf.executing_eagerly() or not graph_local:
            return tf.Variable(initial, trainable=False, name=name)
        return tf.compat.v1.Variable(initial, trainable=False, name=name, use_resource=True,
                                     collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])


class PassAggregator:
    def __init__(self, passes: int, average: bool, graph_local: bool = False):
        if passes < 2:
            raise ValueError("PassAggregator needs backward_passes_per_step >= 2.")
        self.passes = int(passes)
        self.average = bool(average)
        self._graph_local = graph_local
        self.counter = _make_variable(lambda: tf.constant(0, tf.int32), "bps_aggregation_counter",
                                      graph_local)
        self._sums = {}

    def _sum_for(self, variable):
        key = id(variable)
        if key not in self._sums:
            dtype = tf.as_dtype(variable.dtype).base_dtype
            self._sums[key] = (variable, _make_variable(
                lambda: tf.zeros(variable.shape, dtype), "bps_aggregated_gradient",
                self._graph_local))
        return self._sums[key][1]

    def _accumulate(self, pairs):
        """Adds this batch's gradients; returns the sums and the count."""
        sums = [self._sum_for(v) for _, v in pairs]
        adds = [s.assign_add(tf.convert_to_tensor(g)) for (g, _), s in zip(pairs, sums)]
        with tf.control_dependencies(adds):
            return sums, self.counter.assign_add(1)

    def _summed(self, pairs, sums, reduce_fn):
        """The sums (over the passes: averaged if asked), reduced."""
        grads = [s.read_value() for s in sums]
        if self.average:
            grads = [g / tf.cast(self.passes, g.dtype) for g in grads]
        return reduce_fn(grads, [v for _, v in pairs])

    def _reset(self, sums, after):
        """Zeroes the sums and the count once the ops in ``after`` ran."""
        with tf.control_dependencies(after):
            resets = [s.assign(tf.zeros_like(s)) for s in sums]
            resets.append(self.counter.assign(0))
        return resets

    def apply(self, grads_and_vars, reduce_fn, apply_fn, count_fn):
        """Adds this batch's gradients; on the passes-th batch returns
        ``apply_fn`` of the reduced sums, else ``count_fn()`` (which
        advances the optimizer's iteration count).

        ``reduce_fn(grads, variables)`` reduces across workers;
        ``apply_fn(grads_and_vars)`` is the wrapped optimizer's update."""
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        sums, count = self._accumulate(pairs)

        def exchange():
            variables = [v for _, v in pairs]
            applied = apply_fn(list(zip(self._summed(pairs, sums, reduce_fn), variables)))
            resets = self._reset(sums, [applied] if applied is not None else [])
            with tf.control_dependencies(resets):
                return tf.constant(True)

        def count_only():
            counted = count_fn()
            with tf.control_dependencies([counted] if counted is not None else []):
                return tf.constant(False)

        return tf.cond(tf.equal(count, self.passes), exchange, count_only)

    def reduce(self, grads, variables, reduce_fn):
        """TF1's first half: adds this batch's gradients (``None`` stays
        ``None``); on the passes-th batch returns the reduced sums and resets
        them, else this batch's own gradients (not applied: see ready)."""
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        if not pairs:
            return list(grads)
        sums, count = self._accumulate(pairs)

        def exchange():
            reduced = [tf.convert_to_tensor(r) for r in self._summed(pairs, sums, reduce_fn)]
            with tf.control_dependencies(self._reset(sums, reduced)):
                return [tf.identity(r) for r in reduced]

        def local():
            return [tf.identity(tf.convert_to_tensor(g)) for g, _ in pairs]

        out = iter(tf.cond(tf.equal(count, self.passes), exchange, local))
        return [None if g is None else next(out) for g in grads]

    def ready(self, after):
        """TF1's second half: true when the last ``reduce`` exchanged (read
        after the ops in ``after``, the gradients it returned)."""
        with tf.control_dependencies(after):
            return tf.equal(self.counter.read_value(), 0)
