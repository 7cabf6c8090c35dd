"""DistributedGradientTape: a GradientTape whose gradients are push_pulled.

Horovod scripts keep their shape: `tape = bps_tf.DistributedGradientTape(tape)`
then `tape.gradient(loss, variables)` returns gradients summed (or averaged)
over every worker.
"""
from __future__ import annotations

import tensorflow as tf

from bps_tf.api import Average, Compression, predivide_scales, reduce_gradients, resolve_op
from bps_tf.async_training import refuse_gradient_exchange
from bps_tf.process_sets import global_process_set, resolve
from bps_tf.collectives import require_init


class DistributedGradientTape(tf.GradientTape):
    """Wraps a ``tf.GradientTape``; ``gradient`` returns gradients reduced
    across workers (averaged by default).

        with tf.GradientTape() as tape:
            loss = ...
        tape = bps_tf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)

    The wrapper shares the wrapped tape's state, so it may also be made
    before or inside the ``with`` block. Gradient names come from the
    sources' variable paths; priorities from their position (earlier
    first). ``gradient_predivide_factor`` (with ``op=Average``) divides by
    the factor before the sum and by ``size / factor`` after it, as in
    Horovod. ``device_dense``/``device_sparse`` are accepted for
    compatibility; ``num_groups``/``groups`` (Horovod's grouping hint) are
    accepted and change nothing here: bps_tf schedules each gradient by
    priority and the engine batches what is ready together.
    """

    # Our settings live in a slot: the instance __dict__ is the wrapped tape's.
    __slots__ = ("_bps",)

    def __init__(self, gradtape, device_dense="", device_sparse="",
                 compression=Compression.none, sparse_as_dense=False, op=Average,
                 gradient_predivide_factor=1.0, num_groups=0, groups=None,
                 process_set=global_process_set, priority_fn=None):
        refuse_gradient_exchange("DistributedGradientTape")
        if not isinstance(gradtape, tf.GradientTape):
            raise TypeError("DistributedGradientTape wraps a tf.GradientTape, got "
                            f"{type(gradtape).__name__}.")
        # No super().__init__: this object *is* the wrapped tape, state shared.
        resolve(process_set, "DistributedGradientTape")
        del num_groups, groups
        op = resolve_op(None, op)
        prescale, postscale = predivide_scales(op, gradient_predivide_factor,
                                               "DistributedGradientTape")
        object.__setattr__(self, "__dict__", gradtape.__dict__)
        self._bps = dict(compression=compression, sparse_as_dense=sparse_as_dense,
                         op=op, priority_fn=priority_fn,
                         prescale=prescale, postscale=postscale,
                         device_dense=device_dense, device_sparse=device_sparse,
                         process_set=process_set)

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients=output_gradients,
                                 unconnected_gradients=unconnected_gradients)
        require_init()
        flat_sources = tf.nest.flatten(sources, expand_composites=False)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        opts = self._bps
        with tf.device(opts["device_dense"]):
            reduced = reduce_gradients(
                flat_grads, flat_sources, "DistributedGradientTape",
                compression=opts["compression"], sparse_as_dense=opts["sparse_as_dense"],
                op=opts["op"], priority_fn=opts["priority_fn"],
                prescale_factor=opts["prescale"], postscale_factor=opts["postscale"],
                process_set=opts["process_set"])
        return tf.nest.pack_sequence_as(grads, reduced, expand_composites=False)
