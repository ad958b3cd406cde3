"""MatMulQ4 (ops/matmul_q4.cc): bit-identical to its numpy reference on every kernel path, each
row the same whatever the row count and thread count, clean errors for bad weights."""

from __future__ import annotations

import numpy as np
import pytest

from dflash.ops.models import q4_model as one_node
from dflash.ops.reference import matmul_q4, pack_q4, unpack_q4

from test_ops import ORT_ERRORS, lib, session  # noqa: F401  (fixture and helpers)


def q4_model(K, N, weight, scales, a_shape=("M", None)):
    """The one-node model with input a [*a_shape] (None: K)."""
    return one_node(K, N, weight, scales, [K if d is None else d for d in a_shape])


def random_weights(rng, K, N):
    w = rng.standard_normal((K, N)).astype(np.float32) * 0.05
    w[:32, 0] = 0.0  # an all-zero block: scale 0
    return w


def test_packing_round_trips_within_a_step():
    rng = np.random.default_rng(0)
    w = random_weights(rng, 96, 40)
    packed, scales = pack_q4(w)
    assert packed.shape == (3, 3, 256) and scales.shape == (3, 3, 16)
    assert not scales[2, :, 8:].any()  # the padding columns of the last tile
    step = np.abs(np.repeat(scales.transpose(1, 0, 2).reshape(3, 48), 32, axis=0)[:, :40])
    err = np.abs(unpack_q4(packed, scales, 40) - w)
    assert (err <= step / 2 + 1e-7).mean() > 0.99  # rounding; only a +8 clipped to 7 is a full step off
    assert (err <= step + 1e-7).all()


@pytest.mark.parametrize("kernels", [None, "avx2", "portable"])
def test_matches_reference_bit_for_bit(lib, monkeypatch, kernels):
    if kernels:
        monkeypatch.setenv("DFLASH_OPS_KERNELS", kernels)
    rng = np.random.default_rng(1)
    for K, N, M in [(32, 16, 1), (576, 200, 5), (1536, 64, 9), (64, 33, 4)]:
        w = random_weights(rng, K, N)
        packed, scales = pack_q4(w)
        a = rng.standard_normal((M, K)).astype(np.float32)
        a[0, 32:64] = 0.0  # an all-zero activation block
        y = session(q4_model(K, N, packed, scales), threads=2).run(None, {"a": a})[0]
        np.testing.assert_array_equal(y, matmul_q4(a, packed, scales, N))
        assert np.abs(y - a @ w).max() < 0.05 * np.sqrt(K)  # and it is a matmul, within int4 error


@pytest.mark.parametrize("kernels", [None, "avx2", "portable"])
def test_every_row_count_and_tile_edge_matches_the_reference(lib, monkeypatch, kernels):
    """1..33 rows cover every row group of the register-blocked kernels (8 rows on AVX-512, 4 on
    AVX2) with every remainder, at N with a partial last tile (and within one tile) and several K."""
    if kernels:
        monkeypatch.setenv("DFLASH_OPS_KERNELS", kernels)
    rng = np.random.default_rng(5)
    for K, N in [(32, 7), (96, 40), (576, 33), (160, 16)]:
        packed, scales = pack_q4(random_weights(rng, K, N))
        a = rng.standard_normal((40, K)).astype(np.float32)
        a[5, :32] = 0.0  # an all-zero activation block
        ref = matmul_q4(a, packed, scales, N)
        sess = session(q4_model(K, N, packed, scales), threads=2)
        for M in range(1, 34):
            start = (7 * M) % (41 - M)  # the rows at varying places within the row groups
            np.testing.assert_array_equal(sess.run(None, {"a": a[start:start + M]})[0], ref[start:start + M],
                                          err_msg=f"K={K} N={N} M={M} rows {start}..")


def test_rows_round_alike_for_any_row_count_and_threads(lib):
    """A one-token step and a verify of many rows must agree bit for bit (lossless speculation)."""
    rng = np.random.default_rng(2)
    K, N = 576, 96
    packed, scales = pack_q4(random_weights(rng, K, N))
    a = rng.standard_normal((11, K)).astype(np.float32)
    sessions = [session(q4_model(K, N, packed, scales), threads=t) for t in (1, 2)]
    full = sessions[0].run(None, {"a": a})[0]
    for sess in sessions:
        for start, stop in [(0, 1), (3, 4), (0, 2), (2, 7), (0, 11), (5, 10)]:
            np.testing.assert_array_equal(sess.run(None, {"a": a[start:stop]})[0], full[start:stop])


def test_leading_dimensions_and_empty_input(lib):
    rng = np.random.default_rng(3)
    packed, scales = pack_q4(random_weights(rng, 64, 32))
    sess = session(q4_model(64, 32, packed, scales, a_shape=(1, "S", None)))
    a = rng.standard_normal((1, 3, 64)).astype(np.float32)
    np.testing.assert_array_equal(sess.run(None, {"a": a})[0], matmul_q4(a, packed, scales, 32))
    assert sess.run(None, {"a": np.zeros((1, 0, 64), np.float32)})[0].shape == (1, 0, 32)


def test_bad_inputs_are_clean_errors(lib):
    rng = np.random.default_rng(4)
    packed, scales = pack_q4(random_weights(rng, 64, 32))
    with pytest.raises(ORT_ERRORS, match=r"MatMulQ4: weight \[2,2,256\] must be \[3,2,256\]"):
        session(q4_model(64, 48, packed, np.zeros((3, 2, 16), np.float32))).run(
            None, {"a": np.zeros((1, 64), np.float32)})
    with pytest.raises(ORT_ERRORS, match=r"MatMulQ4: scales \[2,2,8\] must be \[2,2,16\]"):
        session(q4_model(64, 32, packed, scales[:, :, :8].copy())).run(None, {"a": np.zeros((1, 64), np.float32)})
    with pytest.raises(ORT_ERRORS, match=r"MatMulQ4: input a \[1,32\] must end in K = 64"):
        session(q4_model(64, 32, packed, scales, a_shape=("M", "K"))).run(None, {"a": np.zeros((1, 32), np.float32)})
    with pytest.raises(ORT_ERRORS, match="MatMulQ4: K = 48 must be a positive multiple of 32"):
        session(q4_model(48, 32, packed, scales))
