"""MatMulQ8 (ops/matmul_q8.cc): bit-identical to its numpy reference on every kernel path, each
row the same whatever the row count and thread count, clean errors for bad weights."""

from __future__ import annotations

import numpy as np
import pytest

from dflash.ops.models import q8_model as one_node
from dflash.ops.reference import matmul_q8, pack_q8, unpack_q8

from test_ops import ORT_ERRORS, lib, session  # noqa: F401  (fixture and helpers)

PATHS = [None, "avx2", "portable"]  # None: the best the CPU has


def q8_model(K, N, weight, scales, a_shape=("M", None)):
    """The one-node model with input a [*a_shape] (None: K)."""
    return one_node(K, N, weight, scales, [K if d is None else d for d in a_shape])


def random_weights(rng, K, N):
    w = rng.standard_normal((K, N)).astype(np.float32) * 0.05
    w[:32, 0] = 0.0  # an all-zero block: scale 0
    return w


def test_packing_round_trips_within_half_a_step():
    rng = np.random.default_rng(0)
    w = random_weights(rng, 96, 40)
    packed, scales = pack_q8(w)
    assert packed.shape == (3, 3, 512) and scales.shape == (3, 3, 16)
    assert not scales[2, :, 8:].any() and (packed.reshape(3, 3, 8, 16, 4)[2, :, :, 8:] == 128).all()
    step = np.abs(np.repeat(scales.transpose(1, 0, 2).reshape(3, 48), 32, axis=0)[:, :40])
    assert (np.abs(unpack_q8(packed, scales, 40) - w) <= step / 2 + 1e-7).all()
    assert packed.min() == 0  # a block's largest-magnitude weight lands on -128 when it is negative


@pytest.mark.parametrize("kernels", PATHS)
def test_matches_reference_bit_for_bit(lib, monkeypatch, kernels):
    if kernels:
        monkeypatch.setenv("DFLASH_OPS_KERNELS", kernels)
    rng = np.random.default_rng(1)
    for K, N, M in [(32, 16, 1), (576, 200, 5), (1536, 64, 9), (64, 33, 4), (96, 7, 13)]:
        w = random_weights(rng, K, N)
        packed, scales = pack_q8(w)
        a = rng.standard_normal((M, K)).astype(np.float32)
        a[0, 32:64] = 0.0  # an all-zero activation block
        y = session(q8_model(K, N, packed, scales), threads=2).run(None, {"a": a})[0]
        np.testing.assert_array_equal(y, matmul_q8(a, packed, scales, N))
        assert np.abs(y - a @ w).max() < 0.01 * np.sqrt(K)  # and it is a matmul, within int8 error


@pytest.mark.parametrize("kernels", PATHS)
def test_extreme_weights_and_activations_stay_exact(lib, monkeypatch, kernels):
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
    y = session(q8_model(K, N, packed, scales)).run(None, {"a": a})[0]
    np.testing.assert_array_equal(y, matmul_q8(a, packed, scales, N))


@pytest.mark.parametrize("kernels", PATHS)
def test_rows_round_alike_for_any_row_count_and_threads(lib, monkeypatch, kernels):
    """A one-token step and a verify of many rows must agree bit for bit (lossless speculation):
    every row count 1..33 (all the row-group remainders of every path) and 1 or 2 threads, on a
    partial last tile."""
    if kernels:
        monkeypatch.setenv("DFLASH_OPS_KERNELS", kernels)
    rng = np.random.default_rng(2)
    K, N = 160, 75
    packed, scales = pack_q8(random_weights(rng, K, N))
    a = rng.standard_normal((33, K)).astype(np.float32)
    full = matmul_q8(a, packed, scales, N)
    for threads in (1, 2):
        sess = session(q8_model(K, N, packed, scales), threads=threads)
        for rows in range(1, 34):
            start = (7 * rows) % (34 - rows)
            np.testing.assert_array_equal(sess.run(None, {"a": a[start:start + rows]})[0], full[start:start + rows])


def test_leading_dimensions_and_empty_input(lib):
    rng = np.random.default_rng(3)
    packed, scales = pack_q8(random_weights(rng, 64, 32))
    sess = session(q8_model(64, 32, packed, scales, a_shape=(1, "S", None)))
    a = rng.standard_normal((1, 3, 64)).astype(np.float32)
    np.testing.assert_array_equal(sess.run(None, {"a": a})[0], matmul_q8(a, packed, scales, 32))
    assert sess.run(None, {"a": np.zeros((1, 0, 64), np.float32)})[0].shape == (1, 0, 32)


def test_bad_inputs_are_clean_errors(lib):
    rng = np.random.default_rng(4)
    packed, scales = pack_q8(random_weights(rng, 64, 32))
    with pytest.raises(ORT_ERRORS, match=r"MatMulQ8: weight \[2,2,512\] must be \[3,2,512\]"):
        session(q8_model(64, 48, packed, np.zeros((3, 2, 16), np.float32))).run(
            None, {"a": np.zeros((1, 64), np.float32)})
    with pytest.raises(ORT_ERRORS, match=r"MatMulQ8: scales \[2,2,8\] must be \[2,2,16\]"):
        session(q8_model(64, 32, packed, scales[:, :, :8].copy())).run(None, {"a": np.zeros((1, 64), np.float32)})
    with pytest.raises(ORT_ERRORS, match=r"MatMulQ8: input a \[1,32\] must end in K = 64"):
        session(q8_model(64, 32, packed, scales, a_shape=("M", "K"))).run(None, {"a": np.zeros((1, 32), np.float32)})
    with pytest.raises(ORT_ERRORS, match="MatMulQ8: K = 48 must be a positive multiple of 32"):
        session(q8_model(48, 32, packed, scales))
