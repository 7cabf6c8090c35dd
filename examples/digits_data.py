"""Handwriting-like digits drawn on the fly: the examples' data, with nothing
to download and no dataset package to install.

Each digit is a few pen strokes (polylines in a unit box). Every sample
moves the stroke points a little, then slants, rotates, scales and shifts the
whole digit, draws it with a pen of random width on a 32x32 grid and counts
the inked pixels of each 4x4 block: 8x8 images with values 0..16, the layout
of the classic optical-digits benchmark. The same seed gives the same data
on every worker (on CPUs whose float32 matrix products round differently,
a pixel on the edge of a stroke may differ: never the sizes or the labels).

Why not a dataset package: scikit-learn (where such digits usually come
from) makes every ``import tensorflow`` about 1.5 s slower once it is
installed, because Keras then loads its scikit-learn wrappers; a job starts
many TensorFlow processes.
"""
import numpy as np

# Stroke points of each digit, (x, y) in a unit box, y down. Ellipses are
# written as their centre and radii and turned into points below.
_ELLIPSE = "ellipse"
_STROKES = {
    0: [(_ELLIPSE, (0.5, 0.5), (0.28, 0.42))],
    1: [[(0.32, 0.28), (0.55, 0.08), (0.55, 0.92)]],
    2: [[(0.2, 0.3), (0.32, 0.12), (0.58, 0.07), (0.78, 0.22), (0.72, 0.45), (0.2, 0.92),
         (0.84, 0.92)]],
    3: [[(0.2, 0.15), (0.62, 0.07), (0.78, 0.25), (0.45, 0.47), (0.8, 0.64), (0.7, 0.9),
         (0.2, 0.86)]],
    4: [[(0.66, 0.92), (0.66, 0.08), (0.14, 0.64), (0.86, 0.64)]],
    5: [[(0.8, 0.08), (0.3, 0.08), (0.26, 0.44), (0.62, 0.4), (0.8, 0.6), (0.7, 0.86),
         (0.2, 0.88)]],
    6: [[(0.72, 0.08), (0.38, 0.3), (0.24, 0.62), (0.36, 0.9), (0.64, 0.9), (0.76, 0.68),
         (0.6, 0.5), (0.3, 0.56)]],
    7: [[(0.18, 0.1), (0.82, 0.1), (0.4, 0.92)], [(0.36, 0.5), (0.7, 0.5)]],
    8: [(_ELLIPSE, (0.5, 0.28), (0.22, 0.2)), (_ELLIPSE, (0.5, 0.7), (0.27, 0.22))],
    9: [(_ELLIPSE, (0.48, 0.32), (0.25, 0.22)), [(0.73, 0.34), (0.7, 0.62), (0.62, 0.92)]],
}
GRID = 32      # drawn at 32x32, then 4x4 blocks counted: 8x8 images of 0..16
BLOCK = 4


def _strokes(digit):
    """The digit's strokes, each an array of points (P, 2)."""
    strokes = []
    for stroke in _STROKES[digit]:
        if stroke[0] == _ELLIPSE:
            (cx, cy), (rx, ry) = stroke[1], stroke[2]
            angle = np.linspace(0.0, 2 * np.pi, 17)
            strokes.append(np.stack([cx + rx * np.sin(angle), cy - ry * np.cos(angle)], axis=1))
        else:
            strokes.append(np.asarray(stroke, dtype=np.float64))
    return strokes


def _segments(strokes):
    """Consecutive points of each stroke as (start, end) pairs: (..., S, 2, 2)
    for strokes of shape (..., P, 2)."""
    return np.concatenate([np.stack([p[..., :-1, :], p[..., 1:, :]], axis=-2) for p in strokes],
                          axis=-3)


def _draw(segments, width):
    """Images (N, GRID, GRID): 1.0 where a pixel's centre is within width/2
    (N,) of one of its image's segments (N, S, 2, 2), else 0.0."""
    centres = (np.arange(GRID, dtype=np.float32) + 0.5) / GRID
    pixels = np.stack(np.meshgrid(centres, centres), axis=-1).reshape(-1, 2)   # (x, y)
    start = segments[:, :, 0].astype(np.float32)
    along = segments[:, :, 1].astype(np.float32) - start
    length2 = np.maximum((along ** 2).sum(-1), 1e-12)[:, None, :]
    # With w = pixel - start: the nearest point is start + t * along, t the
    # projection of w clipped to the segment, and |w - t along|^2 expands to
    # |w|^2 - 2 t (w . along) + t^2 |along|^2, whose dot products are matmuls.
    w_along = pixels @ along.transpose(0, 2, 1) - (start * along).sum(-1)[:, None, :]
    w2 = ((pixels ** 2).sum(-1)[None, :, None] - 2 * pixels @ start.transpose(0, 2, 1)
          + (start ** 2).sum(-1)[:, None, :])
    t = np.clip(w_along / length2, 0.0, 1.0)
    distance2 = (w2 - 2 * t * w_along + t * t * length2).min(axis=-1)
    return (distance2 < (width[:, None] / 2) ** 2).astype(np.float64).reshape(-1, GRID, GRID)


def load_digits(count=1797, seed=0):
    """``count`` images, flattened to 64 values of 0..16 (float64), and their
    labels 0..9 (int64), in a random order; the classes are balanced."""
    rng = np.random.RandomState(seed)
    labels = rng.permutation(np.arange(count) % 10).astype(np.int64)
    images = np.empty((count, 64))
    for digit, shape in ((d, _strokes(d)) for d in sorted(_STROKES)):
        rows = np.flatnonzero(labels == digit)
        n = len(rows)
        # The pen wanders a little at every point; then each digit is slanted,
        # rotated and scaled around the centre, and shifted.
        rot = rng.normal(0.0, np.radians(8), n)
        slant = rng.uniform(-0.25, 0.25, n)
        scale = rng.uniform(0.75, 1.0, (n, 2))
        cos, sin = np.cos(rot), np.sin(rot)
        rotate = np.stack([np.stack([cos, -sin], -1), np.stack([sin, cos], -1)], -2)
        shear = np.zeros((n, 2, 2))
        shear[:, 0, 0] = shear[:, 1, 1] = 1.0
        shear[:, 0, 1] = slant
        transform = rotate @ shear @ (np.eye(2) * scale[:, None, :])
        shift = 0.5 + rng.uniform(-0.07, 0.07, (n, 1, 2))
        strokes = [(p + rng.normal(0.0, 0.025, (n,) + p.shape) - 0.5) @ transform.transpose(0, 2, 1)
                   + shift for p in shape]
        width = rng.uniform(0.07, 0.13, n)
        for chunk in range(0, n, 256):   # bounds the memory of the distances
            part = slice(chunk, chunk + 256)
            ink = _draw(_segments([p[part] for p in strokes]), width[part])
            images[rows[part]] = ink.reshape(-1, 8, BLOCK, 8, BLOCK).sum(axis=(2, 4)).reshape(-1, 64)
    return images, labels
