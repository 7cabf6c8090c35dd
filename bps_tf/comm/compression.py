"""Gradient compression: what travels instead of a tensor, and back.

Horovod's spelling: ``Compression.none`` and ``Compression.fp16``, classes
with ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``;
and the core's compressors, made by factories that every face accepts:

    Compression.onebit(scaling=True, error_feedback=False, momentum=None)
    Compression.topk(ratio, error_feedback=False, momentum=None)
    Compression.randomk(ratio, seed=None, error_feedback=False, momentum=None)
    Compression.dithering(levels, seed=None, error_feedback=False, momentum=None)

Both faces use them: ``push_pull``/``DistributedGradientTape``/
``DistributedOptimizer(compression=...)`` and ``BytePSStrategy(compression=...)``.

fp16 through bps_tf's collectives is scaled so no sum overflows float16's
range (``bps_tf.comm.collectives.push_pull_sum_fp16``); ``compress`` alone is the
plain cast. The core's compressors run inside the C++ engine (worker:
compress each partition, server: decompress, sum in float32, re-compress),
on float32 tensors of at least ``BYTEPS_MIN_COMPRESS_BYTES``; see
docs/compression.md.
"""
from __future__ import annotations

import math

import tensorflow as tf

from bps_tf.runtime import basics

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "CoreCompressor", "Compression",
           "is_fp16", "is_core", "core_spec", "check_supported"]


class Compressor:
    """Turns a tensor into what travels, and back. ``ctx`` carries what
    ``decompress`` needs (here: the original dtype)."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """float32/float64 travel as float16 (half the bytes); other dtypes are
    left alone. Through ``push_pull``/``allreduce`` (and so the tape and the
    optimizer) the values are first scaled by a power of two agreed across
    workers, so no sum overflows float16's range (see
    ``bps_tf.comm.collectives.push_pull_sum_fp16``); ``compress`` alone is the plain
    cast."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype in (tf.float32, tf.float64):
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class CoreCompressor(Compressor):
    """One of the C++ core's compressors with its parameters (made by the
    ``Compression`` factories). ``spec`` is the text the core receives; every
    worker must use the same one (the scheduler refuses a mismatch).

    ``compress(x)`` returns the bytes the core would send for ``x`` as one
    partition (a uint8 tensor) and ``decompress`` turns them back into the
    quantized tensor. These direct calls keep no state: no error feedback,
    no momentum, and a fixed random stream (from the seed). Tensors other
    than float32 pass through unchanged, as in the core."""

    def __init__(self, spec: str):
        self.spec = basics.core().compressor_text(spec)   # ValueError if invalid

    def __repr__(self):
        return f"bps_tf.Compression<{self.spec}>"

    def __eq__(self, other):
        return isinstance(other, CoreCompressor) and other.spec == self.spec

    def __hash__(self):
        return hash(self.spec)

    def _stream(self) -> int:
        seed = int(self.spec.split("seed=")[1].split()[0]) if "seed=" in self.spec else 0
        return basics.core().stream_seed(seed, 0, 0, 0)

    def compress(self, tensor):
        tensor = tf.convert_to_tensor(tensor)
        if tensor.dtype != tf.float32:
            return tensor, None
        spec, stream = self.spec, self._stream()

        def run(x):
            return basics.core().compress(spec, x.reshape(-1), stream)

        payload = tf.numpy_function(run, [tensor], tf.uint8, stateful=False)
        payload.set_shape([None])
        return payload, tf.shape(tensor)

    def decompress(self, tensor, ctx):
        if ctx is None:
            return tensor
        spec = self.spec

        def run(payload, shape):
            count = int(math.prod(int(d) for d in shape))
            return basics.core().decompress(spec, payload, count).reshape(shape)

        return tf.numpy_function(run, [tensor, ctx], tf.float32, stateful=False)


def _flags(error_feedback, momentum) -> str:
    if momentum is not None and not 0 <= float(momentum) < 1:
        raise ValueError(f"momentum={momentum} must be in [0, 1) (or None).")
    return f" ef={int(bool(error_feedback))} momentum={float(momentum or 0.0)!r}"


def _ratio(ratio) -> float:
    ratio = float(ratio)
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio={ratio} must be in (0, 1]: the fraction of elements sent.")
    return ratio


def _seed(seed) -> int:
    seed = 0 if seed is None else int(seed)
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed={seed} must be a non-negative 64-bit integer.")
    return seed


class Compression:
    """``none`` and ``fp16`` as in Horovod, and factories of the core's
    compressors (each takes ``error_feedback=`` and ``momentum=``)."""
    none = NoneCompressor
    fp16 = FP16Compressor

    @staticmethod
    def onebit(scaling=True, error_feedback=False, momentum=None) -> CoreCompressor:
        """The sign of each element, times mean(|x|) of its partition
        (``scaling``) or 1."""
        return CoreCompressor(f"onebit scaling={int(bool(scaling))}"
                              + _flags(error_feedback, momentum))

    @staticmethod
    def topk(ratio, error_feedback=False, momentum=None) -> CoreCompressor:
        """The k = ceil(ratio * n) largest-magnitude elements of each partition."""
        return CoreCompressor(f"topk ratio={_ratio(ratio)!r}" + _flags(error_feedback, momentum))

    @staticmethod
    def randomk(ratio, seed=None, error_feedback=False, momentum=None) -> CoreCompressor:
        """k = ceil(ratio * n) elements drawn at random, the same on every
        worker in a step (from ``seed``, the tensor and the step)."""
        return CoreCompressor(f"randomk ratio={_ratio(ratio)!r} seed={_seed(seed)}"
                              + _flags(error_feedback, momentum))

    @staticmethod
    def dithering(levels, seed=None, error_feedback=False, momentum=None) -> CoreCompressor:
        """|x| / max|x| rounded stochastically to one of ``levels`` steps."""
        if int(levels) != levels or not 1 <= int(levels) <= 127:
            raise ValueError(f"levels={levels} must be an integer in [1, 127].")
        return CoreCompressor(f"dithering levels={int(levels)} seed={_seed(seed)}"
                              + _flags(error_feedback, momentum))


def is_fp16(compression) -> bool:
    return compression is FP16Compressor


def is_core(compression) -> bool:
    return isinstance(compression, CoreCompressor)


def core_spec(compression) -> str:
    """The core's compressor text for ``compression`` ("" when the core
    sends the tensor as it is)."""
    if keeps_state(compression) and basics.membership_epoch() is not None:
        raise NotImplementedError(
            f"{compression!r} under elastic training (BYTEPS_ELASTIC=1): its error-feedback "
            "residuals, momentum or random stream live in each worker's engine and servers, "
            "and a membership change cannot roll them back to the last commit (the resumed "
            "run would differ from one started from that commit, silently). Use a stateless "
            "compressor (Compression.fp16, or onebit/topk without error_feedback, momentum "
            "or seed) or none.")
    return compression.spec if is_core(compression) else ""


def keeps_state(compression) -> bool:
    """Whether ``compression`` carries state from step to step in the
    engine (error-feedback residuals, momentum, a random stream), which a
    checkpoint does not hold: a resumed run starts it afresh."""
    if not is_core(compression):
        return False
    spec = compression.spec
    return ("ef=1" in spec or "seed=" in spec or
            any(float(part.split("=")[1]) != 0.0 for part in spec.split()
                if part.startswith("momentum=")))


def check_supported(compression, where: str) -> None:
    """Raises unless ``compression`` is one that ``where`` can honour."""
    if compression in (None, NoneCompressor, FP16Compressor) or is_core(compression):
        return
    raise NotImplementedError(
        f"{where}: compression {getattr(compression, '__name__', compression)!r} is not "
        "available here; use bps_tf.Compression.none, .fp16, or one of the core's "
        "compressors (.onebit(), .topk(), .randomk(), .dithering()).")
