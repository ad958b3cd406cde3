"""SkipRMSNorm (ops/skip_rms_norm.cc): the residual add and RMS norm of ORT's
SkipSimplifiedLayerNormalization, close to a float64 reference, each row the same bits whatever the
row count and thread count (the lossless guarantee), clean errors for bad shapes."""

from __future__ import annotations

import re

import numpy as np
import pytest

from dflash.ops import models, reference

from test_ops import ORT_ERRORS, lib, session  # noqa: F401  (fixture and helpers)


@pytest.mark.parametrize("H", [1, 15, 16, 17, 576, 1000])
def test_matches_the_reference(lib, H):
    rng = np.random.default_rng(H)
    x, skip = (rng.standard_normal((3, 5, H)).astype(np.float32) for _ in range(2))
    gamma = rng.standard_normal(H).astype(np.float32)
    out, total = session(models.skip_rms_norm_model(1e-5)).run(None, {"input": x, "skip": skip, "gamma": gamma})
    want_out, want_total = reference.skip_rms_norm(x, skip, gamma, 1e-5)
    np.testing.assert_array_equal(total, want_total)  # one float add, exactly
    np.testing.assert_allclose(out, want_out, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 8, 200])  # 200 x 576 values: the call goes to the thread pool
def test_a_row_is_bit_identical_whatever_the_batch(lib, threads, rows):
    rng = np.random.default_rng(rows)
    x, skip = (rng.standard_normal((1, rows, 576)).astype(np.float32) * 3 for _ in range(2))
    sess = session(models.skip_rms_norm_model(1e-6, rng.standard_normal(576)), threads)
    full = sess.run(None, {"input": x, "skip": skip})
    for i in {0, rows // 2, rows - 1}:
        alone = sess.run(None, {"input": x[:, i:i + 1], "skip": skip[:, i:i + 1]})
        for got, want in zip(alone, full):
            np.testing.assert_array_equal(got[0, 0], want[0, i])


def test_an_all_zero_row_gives_zeros_not_nan(lib):
    x = np.zeros((2, 8), np.float32)
    out, total = session(models.skip_rms_norm_model(1e-5)).run(
        None, {"input": x, "skip": x, "gamma": np.ones(8, np.float32)})
    assert not np.isnan(out).any() and not out.any() and not total.any()


@pytest.mark.parametrize("feeds, message", [
    ({"input": np.zeros((2, 8)), "skip": np.zeros((2, 7)), "gamma": np.ones(8)}, "skip [2,7] must have the input's shape"),
    ({"input": np.zeros((2, 8)), "skip": np.zeros((2, 8)), "gamma": np.ones(7)}, "gamma [7] must be [8]"),
    ({"input": np.zeros(()), "skip": np.zeros(()), "gamma": np.ones(1)}, "at least one dimension"),
])
def test_bad_shapes_are_clean_errors(lib, feeds, message):
    feeds = {k: np.asarray(v, np.float32) for k, v in feeds.items()}
    with pytest.raises(ORT_ERRORS, match=re.escape(message)):
        session(models.skip_rms_norm_model(1e-5)).run(None, feeds)
