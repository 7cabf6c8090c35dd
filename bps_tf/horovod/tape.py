"""DistributedGradientTape: a GradientTape whose gradients are push_pulled.

Horovod scripts keep their shape: `tape = bps_tf.DistributedGradientTape(tape)`
then `tape.gradient(loss, variables)` returns gradients summed (or averaged)
over every worker.
"""
from __future__ import annotations

import tensorflow as tf

from bps_tf.comm.async_training import refuse_gradient_exchange
from bps_tf.comm.collectives import require_init
from bps_tf.horovod.api import Average, Compression, predivide_scales, reduce_gradients, resolve_op
from bps_tf.runtime.process_sets import global_process_set, resolve


def source_key(source):
    """A hashable identity of a source (Keras 3 variables have no ``ref()``)."""
    return source.ref() if hasattr(source, "ref") else id(source)


def _scale(grad, divisor, factor):
    values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
    if divisor != 1:
        values = values / divisor
    if factor != 1.0:
        values = values * factor
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return values


def reduce_except_local(grads, sources, prefix, local_keys, scale_local,
                        process_set=global_process_set, local_factor=1.0, **reduce_options):
    """``reduce_gradients`` for the sources whose ``source_key`` is not in
    ``local_keys``; a local source's gradient stays this worker's, divided
    by the process set's size when ``scale_local`` (Horovod's
    ``scale_local_gradients``) and multiplied by ``local_factor``. Shared
    by the tape and the optimizers' ``register_local_var``."""
    if process_set is None:
        process_set = global_process_set
    shared = [i for i, s in enumerate(sources) if source_key(s) not in local_keys]
    reduced = reduce_gradients([grads[i] for i in shared], [sources[i] for i in shared],
                               prefix, process_set=process_set, **reduce_options)
    out = list(grads)
    for i, g in zip(shared, reduced):
        out[i] = g
    if local_keys and (scale_local or local_factor != 1.0):
        n = process_set.size() if scale_local else 1
        shared = set(shared)
        for i, g in enumerate(out):
            if i not in shared and g is not None:
                out[i] = _scale(g, n, local_factor)
    return out


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
                 process_set=global_process_set, scale_local_gradients=True,
                 priority_fn=None):
        refuse_gradient_exchange("DistributedGradientTape")
        if not isinstance(gradtape, tf.GradientTape):
            raise TypeError("DistributedGradientTape wraps a tf.GradientTape, got "
                            f"{type(gradtape).__name__}.")
        # No super().__init__: this object *is* the wrapped tape, state shared.
        resolve(process_set, "DistributedGradientTape", members_only=False)
        del num_groups, groups
        op = resolve_op(None, op)
        prescale, postscale = predivide_scales(op, gradient_predivide_factor,
                                               "DistributedGradientTape")
        object.__setattr__(self, "__dict__", gradtape.__dict__)
        self._bps = dict(compression=compression, sparse_as_dense=sparse_as_dense,
                         op=op, priority_fn=priority_fn,
                         prescale=prescale, postscale=postscale,
                         device_dense=device_dense, device_sparse=device_sparse,
                         process_set=process_set, local=set(),
                         scale_local=bool(scale_local_gradients))

    def register_local_source(self, source):
        """Marks a variable as this worker's own (Horovod's name): its gradient
        is not reduced across workers, only divided by the set's size when
        ``scale_local_gradients`` (the default)."""
        self._bps["local"].add(source_key(source))

    def get_local_and_global_gradients(self, target, sources, output_gradients=None):
        """``(local, global)``: lists of ``(variable, gradient)`` for the
        registered local sources and for the reduced others."""
        flat = tf.nest.flatten(sources, expand_composites=False)
        grads = self.gradient(target, flat, output_gradients=output_gradients)
        local = [(v, g) for v, g in zip(flat, grads) if source_key(v) in self._bps["local"]]
        shared = [(v, g) for v, g in zip(flat, grads)
                  if source_key(v) not in self._bps["local"]]
        return local, shared

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients=output_gradients,
                                 unconnected_gradients=unconnected_gradients)
        require_init()
        flat_sources = tf.nest.flatten(sources, expand_composites=False)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        opts = self._bps
        with tf.device(opts["device_dense"]):
            out = reduce_except_local(
                flat_grads, flat_sources, "DistributedGradientTape", opts["local"],
                opts["scale_local"], compression=opts["compression"],
                sparse_as_dense=opts["sparse_as_dense"], op=opts["op"],
                priority_fn=opts["priority_fn"], prescale_factor=opts["prescale"],
                postscale_factor=opts["postscale"], process_set=opts["process_set"])
        return tf.nest.pack_sequence_as(grads, out, expand_composites=False)


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",
                                   compression=Compression.none, sparse_as_dense=False,
                                   op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set,
                                   local_layers=None, scale_local_gradients=True):
    """A DistributedGradientTape that keeps the gradients of ``local_layers``
    (a Keras layer or a list of them) on this worker, as Horovod's."""
    if local_layers is None:
        local_layers = []
    elif not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor,
                                   num_groups, groups, process_set, scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
