"""One reduction request: how a tensor is reduced across workers, decided once.

Both faces reduce through :class:`Reduction`: the Horovod face
(``push_pull``/``allreduce``, ``reducescatter``, the gradients of
``DistributedGradientTape`` and of the Keras and TF1 optimizers) and
``BytePSStrategy``'s cross-device ops (gradients, metrics, moving
statistics, end-of-data agreement). A face says *what* it wants -- the
reduce op, the compression, the scaling, the workers (a process set), how
many contributions each worker's tensor already holds -- and the request
decides *how* it travels:

* min, max and product go to the servers' own reductions (exact, in the
  tensor's dtype, narrow integers carried as int32);
* a sum or average of floats travels as scaled float16 (``Compression.fp16``,
  never overflowing), through the engine's compressors (``onebit`` ...), or
  through a compressor of the user's own (``compress``/``decompress``), or
  as it is; dtypes the op lacks travel widened, exactly;
* an average divides by the contributions: the workers of the membership the
  graph *runs* in (bps_tf.comm.membership), times the replicas each worker
  summed locally; integers are floor-divided (the average of 3 and 4 over
  2 workers is 3, of -3 and -4 is -4), narrow ones before narrowing;
* an ``IndexedSlices`` is gathered (values and indices concatenated over the
  workers), never densified; its average divides the values.

Ops built here read the membership when they run, so they outlive it
(``collectives.membership_free``); a process set's ops carry the membership
epoch instead. ``ReduceOp`` and the Horovod gradient helpers live here too:
the compat layer and the Keras face reduce gradients without the Horovod face.
"""
from __future__ import annotations

import enum
from typing import List, Optional

import tensorflow as tf

from bps_tf.comm import async_training, collectives
from bps_tf.comm import compression as compression_lib
from bps_tf.comm import membership, naming
from bps_tf.comm.compression import Compression, FP16Compressor, NoneCompressor
from bps_tf.runtime import process_sets

__all__ = ["ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product", "SERVER_OPS",
           "resolve_op", "predivide_scales", "Reduction"]


class ReduceOp(enum.IntEnum):
    AVERAGE = 0
    SUM = 1
    # Adasum has no parameter-server equivalent: it exists so that code
    # written for Horovod imports, and fails clearly where used.
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

# Reduce ops the servers compute besides the sum: op -> the kind of
# collectives.reduce_on_servers. They share the sum's key family, so ranks
# that pass different ops under one name fail (the op is declared with the
# shape) instead of waiting for each other under different keys.
SERVER_OPS = {Min: "min", Max: "max", Product: "product"}


def resolve_op(average, op):
    """The ReduceOp of a call given Horovod's ``op`` or deprecated ``average``
    (BytePS names its ops with strings: "Average", "Sum")."""
    if average is not None and op is not None:
        raise ValueError("push_pull/allreduce: give either `op` or the deprecated "
                         "`average`, not both.")
    if op is None:
        op = Sum if average is False else Average
    try:
        op = ReduceOp[op.upper()] if isinstance(op, str) else ReduceOp(op)
    except (KeyError, ValueError):
        raise ValueError(f"unknown reduce op {op!r}: expected Average, Sum, Min, Max or "
                         "Product.") from None
    if op == Adasum:
        raise NotImplementedError(
            "reduce op ADASUM is not available in bps_tf (a parameter server "
            "sums); use Average, Sum, Min, Max or Product.")
    return op


def predivide_scales(op, gradient_predivide_factor, where: str):
    """Horovod's ``gradient_predivide_factor``: (prescale, postscale) that
    split the average into a division by the factor before the sum and the
    rest after it, so large sums stay in range. Only for ``op=Average``."""
    factor = float(gradient_predivide_factor)
    if factor == 1.0:
        return 1.0, 1.0
    if factor <= 0.0:
        raise ValueError(f"{where}: gradient_predivide_factor must be > 0, got {factor}.")
    if op != Average:
        raise ValueError(f"{where}: gradient_predivide_factor needs op=Average, got "
                         f"op={ReduceOp(op).name.title()}.")
    # Average divides the sum by size(): x/f summed, /size, *f == sum/size.
    return 1.0 / factor, factor


def _is_none(compression) -> bool:
    return compression is None or compression is Compression.none or \
        compression is NoneCompressor


class Reduction:
    """What to reduce and how, for one key; :meth:`dense` and :meth:`sparse`
    build it. ``ops`` lists the push_pull ops built (graph mode), so a face
    can find the exchange behind a result.

    ``op``: a ReduceOp. ``compression``: ``None``/``Compression.none``,
    ``Compression.fp16``, an engine compressor (``Compression.topk(...)``) or
    a ``Compressor`` of the user's own. ``replicas``: contributions each
    worker's tensor holds already (the strategy's local replicas, summed
    before), so an average divides by ``replicas`` times the workers.
    ``keep_priority``: the C++ priority pass leaves ``priority`` as given.
    """

    def __init__(self, key: str, op=Sum, *, compression=None, prescale: float = 1.0,
                 postscale: float = 1.0, priority: int = 0, process_set=None,
                 replicas: int = 1, keep_priority: bool = False):
        self.key = key
        self.op = ReduceOp(op)
        self.compression = None if _is_none(compression) else compression
        self.prescale = float(prescale)
        self.postscale = float(postscale)
        self.priority = int(priority)
        self.process_set = process_set or process_sets.global_process_set
        self.replicas = int(replicas)
        self.keep_priority = keep_priority
        self.ops: List = []
        if self.op in SERVER_OPS and self.compression is not None:
            raise ValueError(f"push_pull: op={self.op.name.title()} takes no compression "
                             f"(a compressor approximates a sum); use Compression.none.")
        if self.op in SERVER_OPS and async_training.enabled():
            raise NotImplementedError(
                f"push_pull: op={self.op.name.title()} is not available in asynchronous "
                f"training (BYTEPS_ENABLE_ASYNC=1: the servers keep running sums, not "
                f"rounds); use op=Sum or Average, or synchronous training.")

    # -- where the ops are made ---------------------------------------------
    def _scope(self):
        """The agreement every op of this request is built under."""
        return _Scopes(self)

    def divisor(self):
        """How many contributions an average divides by, read when the graph runs."""
        n = membership.set_size(self.process_set)
        return n * self.replicas if self.replicas != 1 else n

    # -- dense ------------------------------------------------------------------
    def dense(self, tensor):
        """The reduced ``tensor`` (a dense tensor of any reducible dtype)."""
        tensor = tf.convert_to_tensor(tensor)
        with self._scope():
            sent = collectives.scale(tensor, self.prescale, "prescale_factor")
            if self.op in SERVER_OPS:
                result = collectives.reduce_on_servers(sent, self.key, SERVER_OPS[self.op],
                                                       self.priority)
                self._found(result)
            else:
                result = self._sum_or_average(sent)
            return collectives.scale(result, self.postscale, "postscale_factor")

    def _sum_or_average(self, sent):
        c = self.compression
        if c is FP16Compressor and sent.dtype in (tf.float32, tf.float64):
            # Scaled so that no sum overflows float16 (a plain cast would).
            summed, op = collectives.push_pull_sum_fp16(sent, self.key, self.priority,
                                                        with_op=True)
            self.ops.append(op)
            return self._average(summed)
        if compression_lib.is_core(c):
            # The engine compresses each partition (float32 tensors large
            # enough; others travel as they are): summing compress()'s bytes
            # would be wrong.
            return self._exact(sent, compression_lib.core_spec(c))
        if c is not None:
            packed, ctx = c.compress(sent)
            return c.decompress(self._exact(packed), ctx)
        return self._exact(sent)

    def _exact(self, tensor, core_spec: str = ""):
        """Sum (or average) of ``tensor``; narrow integers travel as int32:
        their sum comes back wrapped as the type wraps, their average is the
        floor of the exact mean (taken before narrowing, so it never wraps)."""
        dtype = tensor.dtype
        wide = collectives.WIDEN.get(dtype)
        if wide is None:
            if dtype not in collectives.SUPPORTED_DTYPES:
                raise TypeError(f"cannot reduce a {dtype.name} tensor across workers "
                                f"({self.key}); supported: "
                                f"{', '.join(d.name for d in collectives.REDUCE_DTYPES)}.")
            summed = collectives.push_pull_sum(tensor, self.key, self.priority,
                                               compression=core_spec)
            self._found(summed)
            return self._average(summed)
        summed = collectives.push_pull_sum(tf.cast(tensor, wide), self.key, self.priority)
        self._found(summed)
        return tf.cast(self._average(summed), dtype)

    def _average(self, summed):
        if self.op != Average:
            return summed
        return collectives.divide(summed, self.divisor())

    def _found(self, result):
        op = collectives.push_pull_op(result)
        if op is not None:
            self.ops.append(op)

    # -- sparse -----------------------------------------------------------------
    def sparse(self, slices, horovod: bool = False):
        """An ``IndexedSlices`` (or a list of them: the local replicas',
        concatenated first) reduced by gathering: values and indices of every
        worker, concatenated in rank order, which is exactly the sum a single
        process would have computed. Average divides the values (integers
        floor-divided, keeping their dtype). ``horovod``: Horovod's rules --
        integer values average to floats (true division), and the gathers'
        gradients are Horovod's allgather gradients (averaged)."""
        if self.op in SERVER_OPS:
            raise NotImplementedError(f"push_pull of an IndexedSlices takes Sum or Average, "
                                      f"not {self.op.name}.")
        parts = slices if isinstance(slices, (list, tuple)) else [slices]
        first = parts[0]
        values = tf.concat([p.values for p in parts], 0) if len(parts) > 1 else first.values
        indices = tf.concat([tf.cast(p.indices, tf.int64) for p in parts], 0) \
            if len(parts) > 1 else first.indices
        values = collectives.scale(values, self.prescale, "prescale_factor")
        from bps_tf.comm import exchange   # gathers are built on this module's sums
        gather = dict(process_set=self.process_set, priority=self.priority,
                      average_gradient=horovod)
        with self._scope():
            values, v_ops = exchange.gather_rows(values, naming.part_key(self.key, "values"),
                                                 **gather)
            indices, i_ops = exchange.gather_rows(indices,
                                                  naming.part_key(self.key, "indices"),
                                                  **gather)
        self.ops += v_ops + i_ops
        if self.op == Average:
            n = self.divisor()
            if horovod and values.dtype.is_integer:
                values = tf.cast(values, tf.float64) / tf.cast(n, tf.float64)
            else:
                values = collectives.divide(values, n)
        values = collectives.scale(values, self.postscale, "postscale_factor")
        indices = tf.cast(indices, first.indices.dtype)
        return tf.IndexedSlices(values, indices, first.dense_shape)


class _Scopes:
    """The agreement of a request's ops: its reduce op and process set, built
    to read the membership at run time, and its priority kept if asked."""

    def __init__(self, request: Reduction):
        self.request = request
        self._stack = []

    def __enter__(self):
        r = self.request
        for scope in (collectives.agreement_scope(
                          set=process_sets.set_agreement(r.process_set),
                          op=r.op.name.lower()),
                      collectives.membership_free(),
                      collectives.keep_priority(r.keep_priority)):
            scope.__enter__()
            self._stack.append(scope)
        return self

    def __exit__(self, *exc):
        while self._stack:
            self._stack.pop().__exit__(*exc)
        return False
