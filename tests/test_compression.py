"""The core's gradient compressors against numpy references (bit-exact;
seeded where random), error feedback and momentum, and the Python faces.

No cluster: the core's compressors are reached through the pybind module.
The multi-worker checks are in tests/test_compression_cluster.py.
"""
import math

import numpy as np
import pytest

from bps_tf.runtime import basics

HEADER = 24
MASK = (1 << 64) - 1


def core():
    return basics.core()


# ---------------------------------------------------------------- references
class SplitMix:
    def __init__(self, state):
        self.state = state & MASK

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def uniform(self):
        return np.float32(self.next() >> 40) * np.float32(1.0 / 16777216.0)


def header(kind, n, flags=0, levels=0, ratio=0.0, seed=0):
    return np.frombuffer(
        np.array([(kind, flags, levels, n, ratio, seed)],
                 dtype=[("k", "u1"), ("f", "u1"), ("l", "<u2"), ("n", "<u4"), ("r", "<f8"),
                        ("s", "<u8")]).tobytes(), np.uint8)


def ref_onebit(x, scaling=True, ef=False):
    n = x.size
    scale = np.float32(np.add.accumulate(np.abs(x.astype(np.float64)))[-1] / n) if scaling \
        else np.float32(1.0)
    bits = np.packbits((x < 0).astype(np.uint8), bitorder="little")
    body = np.concatenate([np.frombuffer(scale.tobytes(), np.uint8), bits])
    dec = np.where(x < 0, -scale, scale).astype(np.float32)
    return np.concatenate([header(1, n, flags=int(scaling) | (2 if ef else 0)), body]), dec


def sparse_k(ratio, n):
    return min(n, max(1, math.ceil(ratio * n)))


def ref_sparse(kind, x, idx, ratio, seed=0, ef=False):
    idx = np.sort(np.asarray(idx, dtype=np.uint32))
    dec = np.zeros_like(x)
    dec[idx] = x[idx]
    body = np.concatenate([idx.astype("<u4").view(np.uint8), x[idx].astype("<f4").view(np.uint8)])
    return np.concatenate([header(kind, x.size, flags=1 | (2 if ef else 0), ratio=ratio,
                                  seed=seed), body]), dec


def ref_topk(x, ratio, ef=False):
    k = sparse_k(ratio, x.size)
    order = np.lexsort((np.arange(x.size), -np.abs(x)))
    return ref_sparse(2, x, order[:k], ratio, ef=ef)


def ref_randomk(x, ratio, stream, seed=0):
    n, k = x.size, sparse_k(ratio, x.size)
    perm = list(range(n))
    rng = SplitMix(stream)
    for i in range(k):
        j = i + rng.next() % (n - i)
        perm[i], perm[j] = perm[j], perm[i]
    return ref_sparse(3, x, perm[:k], ratio, seed=seed)


def ref_dithering(x, levels, stream, seed=0):
    scale = np.float32(np.max(np.abs(x)))
    rng = SplitMix(stream)
    s = np.float32(levels)
    q = np.zeros(x.size, np.int8)
    for i, v in enumerate(x):
        c = (np.float32(abs(v)) / scale) * s + rng.uniform()
        level = min(int(np.floor(c)), levels)
        q[i] = -level if v < 0 else level
    dec = (q.astype(np.float32) * scale) / s
    body = np.concatenate([np.frombuffer(scale.tobytes(), np.uint8), q.view(np.uint8)])
    return np.concatenate([header(4, x.size, flags=1, levels=levels, seed=seed), body]), dec


def gradient(n, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


# ------------------------------------------------------------ bit-exactness
@pytest.mark.parametrize("n", [1, 7, 8, 1000, 4099])
@pytest.mark.parametrize("scaling", [True, False])
def test_onebit_matches_numpy(n, scaling):
    x = gradient(n, n)
    spec = f"onebit scaling={int(scaling)}"
    want, dec = ref_onebit(x, scaling)
    got = core().compress(spec, x, 0)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(core().decompress(spec, got, n), dec)
    assert got.size == HEADER + 4 + (n + 7) // 8


@pytest.mark.parametrize("n,ratio", [(1, 0.5), (10, 0.01), (1000, 0.01), (1000, 0.25), (999, 1.0)])
def test_topk_matches_numpy(n, ratio):
    x = gradient(n, n)
    x[::7] = x[0]   # ties: lower index first
    spec = f"topk ratio={ratio}"
    want, dec = ref_topk(x, ratio)
    got = core().compress(spec, x, 0)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(core().decompress(spec, got, n), dec)
    assert got.size == HEADER + 8 * sparse_k(ratio, n)


@pytest.mark.parametrize("n,ratio,stream", [(1, 0.5, 3), (100, 0.1, 12345), (3000, 0.01, 2**63 + 5)])
def test_randomk_matches_numpy(n, ratio, stream):
    x = gradient(n, n)
    spec = f"randomk ratio={ratio} seed=9"
    want, dec = ref_randomk(x, ratio, stream, seed=9)
    got = core().compress(spec, x, stream)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(core().decompress(spec, got, n), dec)
    other = core().compress(spec, x, stream + 1)
    if n > 1:
        assert not np.array_equal(other, got), "another stream picks other indices"


@pytest.mark.parametrize("n,levels,stream", [(5, 1, 1), (1000, 4, 77), (2000, 127, 2**40)])
def test_dithering_matches_numpy(n, levels, stream):
    x = gradient(n, n)
    spec = f"dithering levels={levels} seed=4"
    want, dec = ref_dithering(x, levels, stream, seed=4)
    got = core().compress(spec, x, stream)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(core().decompress(spec, got, n), dec)


def test_dithering_is_unbiased_over_streams():
    x = gradient(64, 3)
    spec = "dithering levels=2"
    mean = np.mean([core().decompress(spec, core().compress(spec, x, s), 64)
                    for s in range(4000)], axis=0)
    scale = np.max(np.abs(x))
    # Each draw's error is at most scale/levels; 4000 draws: 5 sigma < 0.02 * scale.
    assert np.max(np.abs(mean - x)) < 0.02 * scale


def test_zero_tensor_compresses_to_zeros():
    x = np.zeros(100, np.float32)
    for spec in ("onebit scaling=1", "topk ratio=0.1", "randomk ratio=0.1", "dithering levels=3"):
        np.testing.assert_array_equal(core().decompress(spec, core().compress(spec, x, 1), 100), x)


# --------------------------------------------------------- state and errors
def test_error_feedback_is_unbiased_on_a_fixed_gradient():
    # sum(sent) = steps * g - residual: the running mean converges to g when
    # the residual stays bounded, which it does here.
    g = gradient(64, 1)
    peak = np.max(np.abs(g))
    for spec in ("onebit scaling=1 ef=1", "topk ratio=0.02 ef=1", "randomk ratio=0.05 ef=1",
                 "dithering levels=1 ef=1"):
        state = core().CompressorState()
        total = np.zeros_like(g, np.float64)
        residual_norm = {}
        for step in range(1, 1001):
            total += core().decompress(spec, state.encode(spec, g, 0, g.size, step), g.size)
            if step in (250, 1000):
                residual_norm[step] = np.linalg.norm(step * g - total)
        err = np.max(np.abs(total / 1000 - g))
        assert err < 0.05 * peak, (spec, err)
        assert residual_norm[1000] < 2 * residual_norm[250], (spec, residual_norm)
        without = spec.replace("ef=1", "ef=0")
        plain = core().decompress(without, core().compress(without, g, 0), g.size)
        if "dithering" not in spec:   # deterministic ones are biased without it
            assert np.max(np.abs(plain - g)) > 5 * err, spec


def test_error_feedback_matches_numpy_residual():
    g = gradient(300, 2)
    spec = "topk ratio=0.1 ef=1"
    state = core().CompressorState()
    residual = np.zeros_like(g)
    for step in range(5):
        x = g + residual
        want, dec = ref_topk(x, 0.1, ef=True)
        got = state.encode(spec, g, 0, g.size, step)
        np.testing.assert_array_equal(got, want)
        residual = x - dec


def test_momentum_correction_matches_numpy():
    g = gradient(200, 5)
    spec = "onebit scaling=1 ef=1 momentum=0.9"
    mu = np.float32(0.9)
    state = core().CompressorState()
    m = np.zeros_like(g)
    residual = np.zeros_like(g)
    for step in range(4):
        grad = g * np.float32(step + 1)
        m = mu * m + grad
        x = (grad + mu * m) + residual
        want, dec = ref_onebit(x, True, ef=True)
        got = state.encode(spec, grad, 0, g.size, step)
        np.testing.assert_array_equal(got, want)
        residual = x - dec
    # The server's re-compression keeps no momentum of its own.
    plain = core().CompressorState().encode(spec, g, 0, g.size, 0, use_momentum=False)
    np.testing.assert_array_equal(plain, ref_onebit(g, True, ef=True)[0])


def test_state_works_on_the_slice_of_a_partition():
    g = gradient(100, 8)
    spec = "topk ratio=0.1 ef=1"
    whole, parts = core().CompressorState(), core().CompressorState()
    for step in range(3):
        a = whole.encode(spec, g[:50], 0, 100, step)
        b = parts.encode(spec, g[:50], 0, 100, step)
        parts.encode(spec, g[50:], 50, 100, step)
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("text,match", [
    ("gzip", "unknown compressor"), ("topk", "needs ratio"), ("topk ratio=0", r"\(0, 1\]"),
    ("topk ratio=1.5", r"\(0, 1\]"), ("dithering levels=0", r"\[1, 127\]"),
    ("dithering levels=2.5", "integer"), ("onebit momentum=1", r"\[0, 1\)"),
    ("onebit ratio=0.1", "takes no parameter"), ("randomk ratio=0.1 seed=-1", "non-negative"),
    ("onebit ef=x", "not a number"),
])
def test_bad_descriptions_are_refused(text, match):
    with pytest.raises(ValueError, match=match):
        core().compressor_text(text)


def test_canonical_text_round_trips():
    text = core().compressor_text("randomk seed=3 ratio=0.01 ef=1")
    assert text == "randomk ratio=0.01 seed=3 ef=1 momentum=0"
    assert core().compressor_text(text) == text
    assert core().compressor_text("none") == ""


def test_malformed_payload_is_refused():
    x = gradient(100)
    got = core().compress("topk ratio=0.1", x, 0)
    with pytest.raises(ValueError, match="bytes"):
        core().decompress("topk ratio=0.1", got[:-1], 100)
    with pytest.raises(ValueError, match="elements"):
        core().decompress("topk ratio=0.1", core().compress("topk ratio=0.1", x[:99], 0)[:got.size],
                          100)
    bad = got.copy()
    bad[HEADER:HEADER + 4] = 255   # an index beyond the partition
    with pytest.raises(ValueError, match="indices"):
        core().decompress("topk ratio=0.1", bad, 100)


# ------------------------------------------------------------ Python faces
def test_factories_give_the_core_text_and_validate():
    tf = pytest.importorskip("tensorflow")
    del tf
    from bps_tf import Compression
    assert Compression.onebit().spec == "onebit scaling=1 ef=0 momentum=0"
    assert Compression.topk(0.01, error_feedback=True, momentum=0.9).spec == \
        "topk ratio=0.01 ef=1 momentum=0.9"
    assert Compression.randomk(0.5, seed=7).spec == "randomk ratio=0.5 seed=7 ef=0 momentum=0"
    assert Compression.dithering(4).spec == "dithering levels=4 seed=0 ef=0 momentum=0"
    assert Compression.topk(0.01) == Compression.topk(0.01) != Compression.topk(0.02)
    for make, match in [(lambda: Compression.topk(0), "ratio"),
                        (lambda: Compression.randomk(2.0), "ratio"),
                        (lambda: Compression.dithering(200), "levels"),
                        (lambda: Compression.dithering(2.5), "levels"),
                        (lambda: Compression.onebit(momentum=1.0), "momentum"),
                        (lambda: Compression.randomk(0.1, seed=-1), "seed")]:
        with pytest.raises(ValueError, match=match):
            make()


def test_direct_compress_decompress_gives_the_cores_quantization():
    tf = pytest.importorskip("tensorflow")
    from bps_tf import Compression
    x = gradient(600, 4).reshape(20, 30)
    comp = Compression.onebit()
    payload, ctx = comp.compress(tf.constant(x))
    assert payload.dtype == tf.uint8 and payload.shape[0] == HEADER + 4 + 75
    back = comp.decompress(payload, ctx)
    np.testing.assert_array_equal(back.numpy(), ref_onebit(x.reshape(-1))[1].reshape(20, 30))

    topk = Compression.topk(0.1)
    fn = tf.function(lambda t: topk.decompress(*topk.compress(t)))
    np.testing.assert_array_equal(fn(tf.constant(x)).numpy(),
                                  ref_topk(x.reshape(-1), 0.1)[1].reshape(20, 30))
    ints = tf.range(10)
    same, ctx = topk.compress(ints)
    assert ctx is None and topk.decompress(same, ctx) is same


def test_check_supported_takes_the_cores_compressors_only():
    pytest.importorskip("tensorflow")
    from bps_tf import Compression
    from bps_tf.comm import compression

    class Custom(compression.Compressor):
        pass

    compression.check_supported(Compression.topk(0.1), "BytePSStrategy")
    compression.check_supported(Compression.fp16, "BytePSStrategy")
    with pytest.raises(NotImplementedError, match="onebit"):
        compression.check_supported(Custom, "BytePSStrategy")
    assert compression.core_spec(Compression.fp16) == ""
    assert compression.core_spec(Compression.dithering(3)).startswith("dithering levels=3")


def test_non_finite_values_are_not_rounded_away():
    x = gradient(256, 6)
    x[17] = np.nan
    for spec in ("onebit scaling=1", "dithering levels=4", "topk ratio=0.01"):
        back = core().decompress(spec, core().compress(spec, x, 1), x.size)
        assert np.isnan(back[17]), spec
    x[17] = np.inf
    for spec in ("onebit scaling=1", "dithering levels=4", "topk ratio=0.01"):
        back = core().decompress(spec, core().compress(spec, x, 1), x.size)
        assert not np.isfinite(back[17]), spec
