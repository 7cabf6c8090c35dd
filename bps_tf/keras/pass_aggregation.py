"""``backward_passes_per_step > 1`` for tf_keras (Keras 2) optimizers.

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
"""
from __future__ import annotations

import tensorflow as tf


class PassAggregator:
    def __init__(self, passes: int, average: bool):
        if passes < 2:
            raise ValueError("PassAggregator needs backward_passes_per_step >= 2.")
        self.passes = int(passes)
        self.average = bool(average)
        with tf.init_scope():
            self.counter = tf.Variable(0, dtype=tf.int32, trainable=False,
                                       name="bps_aggregation_counter")
        self._sums = {}

    def _sum_for(self, variable):
        key = id(variable)
        if key not in self._sums:
            # Created outside any tf.function, so tracing the train step
            # again (or tracing it for the first time) never makes variables.
            with tf.init_scope():
                self._sums[key] = (variable, tf.Variable(
                    tf.zeros(variable.shape, variable.dtype), trainable=False,
                    name="bps_aggregated_gradient"))
        return self._sums[key][1]

    def apply(self, grads_and_vars, reduce_fn, apply_fn, count_fn):
        """Adds this batch's gradients; on the passes-th batch returns
        ``apply_fn`` of the reduced sums, else ``count_fn()`` (which
        advances the optimizer's iteration count).

        ``reduce_fn(grads, variables)`` reduces across workers;
        ``apply_fn(grads_and_vars)`` is the wrapped optimizer's update."""
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        sums = [self._sum_for(v) for _, v in pairs]
        adds = [s.assign_add(tf.convert_to_tensor(g)) for (g, _), s in zip(pairs, sums)]
        with tf.control_dependencies(adds):
            count = self.counter.assign_add(1)

        def exchange():
            grads = [s.read_value() for s in sums]
            if self.average:
                grads = [g / tf.cast(self.passes, g.dtype) for g in grads]
            variables = [v for _, v in pairs]
            applied = apply_fn(list(zip(reduce_fn(grads, variables), variables)))
            with tf.control_dependencies([applied] if applied is not None else []):
                resets = [s.assign(tf.zeros_like(s)) for s in sums]
                resets.append(self.counter.assign(0))
            with tf.control_dependencies(resets):
                return tf.constant(True)

        def count_only():
            counted = count_fn()
            with tf.control_dependencies([counted] if counted is not None else []):
                return tf.constant(False)

        return tf.cond(tf.equal(count, self.passes), exchange, count_only)
