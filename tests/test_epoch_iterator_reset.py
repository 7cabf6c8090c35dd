"""The Keras epoch iterator's reset under bps_tf keeps what it drops until
the next reset (bps_tf/strategy/epoch_length.py): TensorFlow's multi-device
iterator frees its dataset before it stops its prefetch thread, and Keras
drops one right after peeking at its first batch, while that thread fetches
the next (a SIGSEGV in MultiDeviceBuffer::BackgroundThread was seen so)."""
import gc
import os
import weakref

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")

from bps_tf.hooks import roles  # noqa: E402
from bps_tf.strategy import epoch_length  # noqa: E402


def _peeked(iterator_class):
    """An epoch iterator after Keras' peek at its first batch (what fit and
    evaluate do before their reset), with weak references to the iterator
    and the epoch generator a reset drops."""
    epoch = iterator_class(x=np.zeros((8, 2), np.float32), y=np.zeros((8,), np.float32),
                           batch_size=2, distribute_strategy=tf.distribute.get_strategy())
    for _, _, batches in epoch:
        next(batches)
        break
    return epoch, weakref.ref(epoch._current_iterator), weakref.ref(epoch._epoch_iterator)


def test_a_reset_keeps_the_dropped_iterator_until_the_next_reset():
    cls = roles.epoch_iterator_class()
    reset = epoch_length._iterator_reset(cls.reset)
    epoch, current, generator = _peeked(cls)
    reset(epoch)
    gc.collect()
    assert epoch._current_iterator is None            # Keras' reset still ran
    assert current() is not None and generator() is not None
    for _, _, batches in epoch:                        # the next peek, the next reset
        next(batches)
        break
    reset(epoch)
    gc.collect()
    assert current() is None and generator() is None   # released one reset later


def test_without_it_keras_drops_the_iterator_at_once():
    # What the wrapper changes: Keras' own reset frees the peeked iterator.
    cls = roles.epoch_iterator_class()
    epoch, current, generator = _peeked(cls)
    # (Keras' own even where another test of this process installed the hook.)
    getattr(cls.reset, "__wrapped__", cls.reset)(epoch)
    gc.collect()
    assert current() is None and generator() is None
