"""The arrays worker scripts save with ``np.savez(path, *values)``, read
back and compared (the elastic tests check runs bit for bit)."""
import numpy as np


def load(path):
    """The arrays saved at ``path``, in their order."""
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def identical(a, b):
    """Whether two lists of arrays are equal bit for bit."""
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
