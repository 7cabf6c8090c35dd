"""Gradient compression: what travels instead of a tensor, and back.

Horovod's spelling: ``Compression.none`` and ``Compression.fp16``, classes
with ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``.
Both faces use them: ``push_pull``/``DistributedGradientTape``/
``DistributedOptimizer(compression=...)`` and ``BytePSStrategy(compression=...)``.

fp16 through bps_tf's collectives is scaled so no sum overflows float16's
range (``bps_tf.collectives.push_pull_sum_fp16``); ``compress`` alone is the
plain cast.
"""
from __future__ import annotations

import tensorflow as tf

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression", "is_fp16",
           "check_supported"]


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
    ``bps_tf.collectives.push_pull_sum_fp16``); ``compress`` alone is the plain
    cast."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype in (tf.float32, tf.float64):
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor


def is_fp16(compression) -> bool:
    return compression is FP16Compressor


def check_supported(compression, where: str) -> None:
    """Raises unless ``compression`` is one that ``where`` can honour."""
    if compression in (None, NoneCompressor, FP16Compressor):
        return
    raise NotImplementedError(
        f"{where}: compression {getattr(compression, '__name__', compression)!r} is not "
        "available here; use bps_tf.Compression.none or bps_tf.Compression.fp16.")
