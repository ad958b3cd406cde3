"""MatMulQ4 and MatMulQ8 (ops/matmul_q4.cc, ops/matmul_q8.cc): bit-identical to their numpy
references on every kernel path, each row the same whatever the row count and thread count (the
lossless guarantee), clean errors for bad weights. Each packing is checked on its own."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from dflash.ops import models, reference

from test_ops import ORT_ERRORS, lib, session  # noqa: F401  (fixture and helpers)

PATHS = [None, "avx2", "portable"]  # None: the best the CPU has


@dataclass
class Op:
    name: str
    bits: int
    tile_bytes: int
    error: float  # |y - a @ w| allowed, per sqrt(K): the weights' rounding
    asymmetric: bool = False  # with the offsets input
    half: bool = False  # float16 scales (and offsets)
    split: bool = False  # split_activations

    def pack(self, w):
        """(packed, scales) or, asymmetric, (packed, scales, offsets)."""
        if self.asymmetric:
            params = reference.pack_asymmetric(w, self.bits)
        else:
            params = getattr(reference, f"pack_q{self.bits}")(w)
        return (params[0], *(p.astype(np.float16) for p in params[1:])) if self.half else params

    def reference(self, a, packed, scales, N, offsets=None):
        return reference.quantized_matmul(a, packed, scales, N, self.bits, offsets, split=self.split)

    def model(self, K, N, packed, scales, offsets=None, a_shape=("M", None)):
        """The one-node model with input a [*a_shape] (None: K)."""
        one_node = getattr(models, f"q{self.bits}_model")
        return one_node(K, N, packed, scales, [K if d is None else d for d in a_shape], offsets=offsets,
                        split=self.split)


OPS = [Op("MatMulQ4", 4, 256, 0.05), Op("MatMulQ8", 8, 512, 0.01),
       Op("MatMulQ4", 4, 256, 0.05, asymmetric=True), Op("MatMulQ8", 8, 512, 0.01, asymmetric=True),
       Op("MatMulQ4", 4, 256, 0.05, half=True), Op("MatMulQ4", 4, 256, 0.05, asymmetric=True, half=True),
       Op("MatMulQ8", 8, 512, 0.01, asymmetric=True, half=True),
       Op("MatMulQ4", 4, 256, 0.05, asymmetric=True, half=True, split=True), Op("MatMulQ8", 8, 512, 0.01, split=True)]
by_name = pytest.mark.parametrize(
    "op", OPS, ids=lambda op: op.name + ("-asymmetric" if op.asymmetric else "") + ("-fp16" if op.half else "")
    + ("-split" if op.split else ""))


def random_weights(rng, K, N):
    w = rng.standard_normal((K, N)).astype(np.float32) * 0.05
    w[:32, 0] = 0.0  # an all-zero block: scale 0
    return w


def weight_steps(scales, N):
    """Each weight's quantization step [K, N] from scales [T, KB, 16]."""
    T, KB, _ = scales.shape
    return np.abs(np.repeat(scales.transpose(1, 0, 2).reshape(KB, T * 16), 32, axis=0)[:, :N])


def test_q4_packing_round_trips_within_a_step():
    rng = np.random.default_rng(0)
    w = random_weights(rng, 96, 40)
    packed, scales = reference.pack_q4(w)
    assert packed.shape == (3, 3, 256) and scales.shape == (3, 3, 16)
    assert not scales[2, :, 8:].any()  # the padding columns of the last tile
    step = weight_steps(scales, 40)
    err = np.abs(reference.unpack_q4(packed, scales, 40) - w)
    assert (err <= step / 2 + 1e-7).mean() > 0.99  # rounding; only a +8 clipped to 7 is a full step off
    assert (err <= step + 1e-7).all()


def test_q8_packing_round_trips_within_half_a_step():
    rng = np.random.default_rng(0)
    w = random_weights(rng, 96, 40)
    packed, scales = reference.pack_q8(w)
    assert packed.shape == (3, 3, 512) and scales.shape == (3, 3, 16)
    assert not scales[2, :, 8:].any() and (packed.reshape(3, 3, 8, 16, 4)[2, :, :, 8:] == 128).all()
    assert (np.abs(reference.unpack_q8(packed, scales, 40) - w) <= weight_steps(scales, 40) / 2 + 1e-7).all()
    assert packed.min() == 0  # a block's largest-magnitude weight lands on -128 when it is negative


@by_name
@pytest.mark.parametrize("kernels", PATHS)
def test_matches_reference_bit_for_bit(lib, monkeypatch, op, kernels):
    if kernels:
        monkeypatch.setenv("DFLASH_OPS_KERNELS", kernels)
    rng = np.random.default_rng(1)
    for K, N, M in [(32, 16, 1), (576, 200, 5), (1536, 64, 9), (64, 33, 4), (96, 7, 13)]:
        w = random_weights(rng, K, N)
        params = op.pack(w)
        a = rng.standard_normal((M, K)).astype(np.float32)
        a[0, 32:64] = 0.0  # an all-zero activation block
        if M > 1:  # a block whose scaled activations are ties (x.5): every path rounds them to even
            a[1, :32] = (np.arange(32) - 15.5) / 32  # max 127/32, so the scale is 32: q = 32 a
            a[1, 31] = 127 / 32
        y = session(op.model(K, N, *params), threads=2).run(None, {"a": a})[0]
        np.testing.assert_array_equal(y, op.reference(a, *params[:2], N, *params[2:]))
        assert np.abs(y - a @ w).max() < op.error * np.sqrt(K)  # and it is a matmul


@by_name
@pytest.mark.parametrize("kernels", PATHS)
def test_every_row_count_and_tile_edge_matches_the_reference(lib, monkeypatch, op, kernels):
    """1..33 rows cover every row group of the register-blocked kernels (8 rows on AVX-512, 4 on
    AVX2) with every remainder, at N with a partial last tile (and within one tile) and several K;
    1 and 2 threads."""
    if kernels:
        monkeypatch.setenv("DFLASH_OPS_KERNELS", kernels)
    rng = np.random.default_rng(5)
    for K, N, threads in [(32, 7, 1), (96, 40, 2), (576, 33, 2), (160, 75, 1)]:
        params = op.pack(random_weights(rng, K, N))
        a = rng.standard_normal((40, K)).astype(np.float32)
        a[5, :32] = 0.0  # an all-zero activation block
        ref = op.reference(a, *params[:2], N, *params[2:])
        sess = session(op.model(K, N, *params), threads=threads)
        for M in range(1, 34):
            start = (7 * M) % (41 - M)  # the rows at varying places within the row groups
            np.testing.assert_array_equal(sess.run(None, {"a": a[start:start + M]})[0], ref[start:start + M],
                                          err_msg=f"K={K} N={N} M={M} rows {start}..")


@pytest.mark.parametrize("kernels", PATHS)
def test_q8_extreme_weights_and_activations_stay_exact(lib, monkeypatch, kernels):
    """Every u in 0..255 against activations of +-127: the integer sums are largest there (the
    AVX2 path sums nibble products in 16 bits)."""
    if kernels:
        monkeypatch.setenv("DFLASH_OPS_KERNELS", kernels)
    K, N = 64, 48
    rng = np.random.default_rng(5)
    packed = rng.choice(np.array([0, 1, 127, 128, 254, 255], np.uint8), size=(3, 2, 512))
    packed[0, 0] = 255
    packed[0, 1] = 0
    scales = rng.standard_normal((3, 2, 16)).astype(np.float32)
    a = np.sign(rng.standard_normal((6, K))).astype(np.float32)  # all +-1: every q is +-127
    a[1] = 1.0
    a[2] = -1.0
    y = session(models.q8_model(K, N, packed, scales, ["M", K])).run(None, {"a": a})[0]
    np.testing.assert_array_equal(y, reference.matmul_q8(a, packed, scales, N))


@by_name
def test_leading_dimensions_and_empty_input(lib, op):
    rng = np.random.default_rng(3)
    params = op.pack(random_weights(rng, 64, 32))
    sess = session(op.model(64, 32, *params, a_shape=(1, "S", None)))
    a = rng.standard_normal((1, 3, 64)).astype(np.float32)
    np.testing.assert_array_equal(sess.run(None, {"a": a})[0], op.reference(a, *params[:2], 32, *params[2:]))
    assert sess.run(None, {"a": np.zeros((1, 0, 64), np.float32)})[0].shape == (1, 0, 32)


@pytest.mark.parametrize("kernels", PATHS)
def test_every_float16_parameter_is_widened_exactly(lib, monkeypatch, kernels):
    """The portable path widens float16 parameters itself, the others with F16C: each of the 65536
    values (zeros, subnormals, inf, nan) as an offset, times an activation sum of exactly 127."""
    if kernels:
        monkeypatch.setenv("DFLASH_OPS_KERNELS", kernels)
    K, N = 32, 65536
    offsets = np.arange(N, dtype=np.uint16).view(np.float16).reshape(1, N)
    packed = reference.tile_codes(np.zeros((K, N), np.uint8), 4)
    scales = reference.tile_params(np.zeros((1, N), np.float32), N).astype(np.float16)
    offsets = reference.tile_params(offsets.astype(np.float32), N).astype(np.float16)
    a = np.zeros((1, K), np.float32)
    a[0, 0] = 127.0  # q = 127 with scale 1: total = 127
    y = session(models.q4_model(K, N, packed, scales, ["M", K], offsets=offsets)).run(None, {"a": a})[0]
    with np.errstate(invalid="ignore"):  # the nans
        np.testing.assert_array_equal(y, reference.matmul_q4(a, packed, scales, N, offsets))


def test_split_activations_are_nearly_exact():
    """Two int8 rows per row leave ~1/254 of one row's activation rounding."""
    rng = np.random.default_rng(7)
    w = random_weights(rng, 256, 48)
    a = rng.standard_normal((6, 256)).astype(np.float32)
    a[:, 5] *= 40  # an outlier per row, as real activations have
    params = reference.pack_q8(w)
    exact = a.astype(np.float64) @ reference.unpack_q8(*params, 48).astype(np.float64)
    one = np.abs(reference.matmul_q8(a, *params, 48) - exact).max()
    two = np.abs(reference.quantized_matmul(a, *params, 48, 8, split=True) - exact).max()
    assert two < one / 50


def test_asymmetric_blocks_dequantize_as_gguf_q4_1_does():
    """u * scale + offset, one rounding in float32: constant blocks (scale 0) keep their value."""
    rng = np.random.default_rng(2)
    w = random_weights(rng, 64, 24)
    w[32:, 3] = 0.25  # a constant block: scale 0, offset 0.25
    u, scale, offset = reference.minmax_codes(w, 4)
    packed, scales, offsets = reference.pack_asymmetric(w, 4)
    want = (u.astype(np.float32) * np.repeat(scale, 32, axis=0) + np.repeat(offset, 32, axis=0)).astype(np.float32)
    np.testing.assert_array_equal(reference.unpack_q4(packed, scales, 24, offsets), want)
    assert (want[32:, 3] == 0.25).all() and scale[1, 3] == 0
    assert np.abs(want - w).max() <= np.abs(scale).max() / 2 + 1e-7


@pytest.mark.parametrize("kernels", PATHS)
def test_a_constant_weight_block_with_zero_scale_is_exact(lib, monkeypatch, kernels):
    """Asymmetric blocks can be constant (scale 0, offset c): the op gives c * sum(dequantized a)."""
    if kernels:
        monkeypatch.setenv("DFLASH_OPS_KERNELS", kernels)
    K, N = 64, 16
    w = np.full((K, N), -0.5, np.float32)
    params = reference.pack_asymmetric(w, 4)
    a = np.random.default_rng(6).standard_normal((3, K)).astype(np.float32)
    y = session(models.q4_model(K, N, *params[:2], ["M", K], offsets=params[2])).run(None, {"a": a})[0]
    np.testing.assert_array_equal(y, reference.matmul_q4(a, *params[:2], N, params[2]))
    np.testing.assert_allclose(y, a @ w, rtol=0.02)


@pytest.mark.parametrize("op", OPS[:2], ids=lambda op: op.name)
def test_bad_inputs_are_clean_errors(lib, op):
    rng = np.random.default_rng(4)
    packed, scales = op.pack(random_weights(rng, 64, 32))
    one_row = {"a": np.zeros((1, 64), np.float32)}
    with pytest.raises(ORT_ERRORS, match=rf"{op.name}: weight \[2,2,{op.tile_bytes}\] must be \[3,2,{op.tile_bytes}\]"):
        session(op.model(64, 48, packed, np.zeros((3, 2, 16), np.float32))).run(None, one_row)
    with pytest.raises(ORT_ERRORS, match=rf"{op.name}: scales \[2,2,8\] must be \[2,2,16\]"):
        session(op.model(64, 32, packed, scales[:, :, :8].copy())).run(None, one_row)
    with pytest.raises(ORT_ERRORS, match=rf"{op.name}: offsets \[2,1,16\] must be \[2,2,16\] \(as scales\)"):
        session(op.model(64, 32, packed, scales, offsets=scales[:, :1].copy())).run(None, one_row)
    with pytest.raises(ORT_ERRORS, match=rf"{op.name}: offsets must have the scales' type"):
        session(op.model(64, 32, packed, scales, offsets=scales.astype(np.float16))).run(None, one_row)
    with pytest.raises(ORT_ERRORS, match=rf"{op.name}: scales must be float or float16"):
        session(op.model(64, 32, packed, scales.astype(np.float64))).run(None, one_row)
    with pytest.raises(ORT_ERRORS, match=rf"{op.name}: input a \[1,32\] must end in K = 64"):
        session(op.model(64, 32, packed, scales, a_shape=("M", "K"))).run(None, {"a": np.zeros((1, 32), np.float32)})
    with pytest.raises(ORT_ERRORS, match=f"{op.name}: K = 48 must be a positive multiple of 32"):
        session(op.model(48, 32, packed, scales))
