"""SwiGLU (ops/swiglu.cc, the loop in ops/kernels.cc): close to a float64 reference on every kernel
path, each row the same bits whatever the row count and thread count, clean errors for bad shapes;
and the exported MLP uses it only with the project's ops."""

from __future__ import annotations

import numpy as np
import pytest

from dflash.ops import models, reference

from test_ops import ORT_ERRORS, lib, session  # noqa: F401  (fixture and helpers)


@pytest.mark.parametrize("kernels", [None, "avx2", "portable"])
@pytest.mark.parametrize("I", [1, 7, 8, 9, 1536])
def test_matches_the_reference(lib, monkeypatch, kernels, I):
    if kernels:
        monkeypatch.setenv("DFLASH_OPS_KERNELS", kernels)  # read when the session creates the kernel
    rng = np.random.default_rng(I)
    x = rng.standard_normal((2, 3, 2 * I)).astype(np.float32) * 4
    x[0, 0, :2] = [-100.0, 100.0]  # far tails: sigmoid 0 and 1
    y = session(models.swiglu_model()).run(None, {"x": x})[0]
    assert y.shape == (2, 3, I)
    np.testing.assert_allclose(y, reference.swiglu(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 8, 100])  # 100 x 1536 values: the call goes to the thread pool
def test_a_row_is_bit_identical_whatever_the_batch(lib, threads, rows):
    x = np.random.default_rng(rows).standard_normal((1, rows, 3072)).astype(np.float32)
    sess = session(models.swiglu_model(), threads)
    full = sess.run(None, {"x": x})[0]
    for i in {0, rows // 2, rows - 1}:
        np.testing.assert_array_equal(sess.run(None, {"x": x[:, i:i + 1]})[0][0, 0], full[0, i])


def test_an_odd_width_is_a_clean_error(lib):
    with pytest.raises(ORT_ERRORS, match="must end in an even dimension"):
        session(models.swiglu_model()).run(None, {"x": np.zeros((2, 5), np.float32)})
