"""examples/digits_data.py: the examples' data, drawn at start (numpy only)."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import digits_data  # noqa: E402


def test_the_same_seed_gives_the_same_digits_and_another_seed_others():
    x, y = digits_data.load_digits()
    x2, y2 = digits_data.load_digits()
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    x3, _ = digits_data.load_digits(seed=1)
    assert not np.array_equal(x, x3)


def test_images_are_8x8_counts_of_0_to_16_with_balanced_classes():
    x, y = digits_data.load_digits()
    assert x.shape == (1797, 64) and y.shape == (1797,) and y.dtype == np.int64
    assert x.min() == 0 and x.max() == 16 and np.array_equal(x, np.round(x))
    counts = np.bincount(y, minlength=10)
    assert counts.min() >= 179 and counts.max() <= 180, counts
    # Every image has ink, and no image is ink everywhere.
    assert (x.sum(axis=1) > 0).all() and (x.min(axis=1) < 16).all()


def test_the_classes_are_learnable_and_not_trivial():
    # A nearest-centroid classifier fitted on the first 80 %: well above
    # chance on the rest (so the examples can reach their accuracy), yet not
    # perfect (the pen's randomness makes the classes overlap).
    x, y = digits_data.load_digits()
    split = len(x) * 4 // 5
    centroids = np.stack([x[:split][y[:split] == d].mean(axis=0) for d in range(10)])
    distance = ((x[split:, None, :] - centroids[None]) ** 2).sum(axis=-1)
    accuracy = (distance.argmin(axis=1) == y[split:]).mean()
    assert 0.6 < accuracy < 0.99, accuracy
