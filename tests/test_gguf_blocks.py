"""GGUF tensors kept in their own quantization (export/gguf_blocks.py): every kept type decodes to
gguf-py's dequantized values bit for bit, and a weight is found by value in any column order."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import dequantize

from dflash.export import gguf_blocks
from dflash.export.blocks import BlockWeight

K_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)


def random_tensor(rng, qtype, rows: int, K: int) -> np.ndarray:
    """Random blocks of `qtype` (any bit pattern is a block) with finite, small fp16 scales."""
    per_row = K // (256 if qtype in K_TYPES else 32)
    blocks = rng.integers(0, 256, size=(rows * per_row, gguf_blocks.BLOCK_BYTES[qtype]), dtype=np.uint8)
    half = lambda: (rng.standard_normal((rows * per_row, 1)) * 0.01).astype(np.float16).view(np.uint8)
    if qtype == T.Q6_K:
        blocks[:, 208:210] = half()
    else:
        blocks[:, 0:2] = half()
        if qtype in (T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K):
            blocks[:, 2:4] = half()
    return blocks.reshape(rows, -1)


def as_weight(decoded) -> BlockWeight:
    bits, codes, scales, offsets, exact = decoded
    return BlockWeight(bits, codes.T, scales.T, None if offsets is None else offsets.T, exact)


@pytest.mark.parametrize("qtype", list(gguf_blocks.BLOCK_BYTES), ids=lambda t: t.name)
def test_every_kept_type_dequantizes_as_gguf_does(qtype):
    rng = np.random.default_rng(int(qtype))
    K, rows = 512, 6
    data = random_tensor(rng, qtype, rows, K)
    weight = as_weight(gguf_blocks.decode(qtype, data, K))
    want = dequantize(data, qtype).reshape(rows, K).T
    if qtype == T.Q6_K:  # near-exact: int8 per 32 of the Q6_K values
        assert not weight.exact and weight.bits == 8
        steps = np.repeat(np.abs(weight.scales), 32, axis=0)
        assert (np.abs(weight.dequantized() - want) <= steps / 2 + 1e-6 * np.abs(want)).all()
    else:
        assert weight.exact and weight.bits == (4 if qtype in (T.Q4_0, T.Q4_1, T.Q4_K) else 8)
        np.testing.assert_array_equal(weight.dequantized(), want)
        asymmetric = qtype in (T.Q4_1, T.Q4_K, T.Q5_1, T.Q5_K)
        assert (weight.offsets is not None) == asymmetric


def test_a_float_tensor_is_not_kept():
    assert gguf_blocks.decode(T.F32, np.zeros((2, 128), np.uint8), 32) is None


def test_a_weight_is_found_by_value_in_any_column_order(tmp_path):
    """A fused projection (two tensors of different formats side by side, rows permuted): each
    column in its tensor's blocks, widened to the wider op, equal to the dequantized values."""
    import gguf

    rng = np.random.default_rng(3)
    K = 256
    q41, q80 = random_tensor(rng, T.Q4_1, 8, K), random_tensor(rng, T.Q8_0, 4, K)
    path = tmp_path / "weights.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("a.weight", q41, raw_dtype=T.Q4_1)
    writer.add_tensor("b.weight", q80, raw_dtype=T.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    found = gguf_blocks.GGUFBlocks(path)

    a = dequantize(q41, T.Q4_1).reshape(8, K)
    b = dequantize(q80, T.Q8_0).reshape(4, K)
    alone = found.find(a[[3, 1, 0, 2, 7, 6, 5, 4]].T.copy())
    assert alone.bits == 4 and alone.offsets is not None and alone.exact
    fused = np.concatenate([a[::-1], b], axis=0).T.copy()  # [K, 12]
    weight = found.find(fused)
    assert weight.bits == 8 and weight.offsets is not None
    np.testing.assert_allclose(weight.dequantized(), fused, rtol=1e-6, atol=1e-7)
    assert found.find(fused + np.float32(1e-3)) is None  # values that are not the file's
