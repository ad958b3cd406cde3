"""A GGUF file's own quantization, kept: each tensor's blocks read as codes, scales and offsets per
block of 32 along K (export/blocks.py), so a quantized bundle multiplies by exactly the weights the
fp32 bundle holds (GGUF's dequantized values), and only the activations' int8 rounding differs.

    GGUF type   kept as                                       exact
    Q4_0        MatMulQ4, u = q, scale d                       yes
    Q4_1        MatMulQ4 asymmetric, scale d, offset m         yes
    Q4_K        MatMulQ4 asymmetric, sub-blocks of 32: scale d*sc, offset -dmin*m   yes
    Q5_0        MatMulQ8, u = q + 112 (q - 16 + 128), scale d  yes
    Q5_1, Q5_K  MatMulQ8 asymmetric, u = q (0..31)             yes
    Q8_0        MatMulQ8, u = q + 128, scale d                 yes
    Q6_K        MatMulQ8, its values re-rounded to int8 per 32 (16-element sub-scales do not fit one
                scale per 32): error <= 1/8 of a Q6_K step     near

Block layouts follow ggml (ggml-common.h; gguf-py's quants.py dequantizes the same bytes, and the
tests check every type against it bit for bit). Other types are not kept (None): their values go
through the float quantizer.
"""

from __future__ import annotations

import hashlib

import numpy as np
from gguf import GGMLQuantizationType as T

from .blocks import BlockWeight

# type -> bytes per block of 32 (256 for the K types)
BLOCK_BYTES = {T.Q4_0: 18, T.Q4_1: 20, T.Q5_0: 22, T.Q5_1: 24, T.Q8_0: 34, T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row as one float16, widened to float32 (exactly)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] codes: element j in the low nibble of byte j, j + 16 in the high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes (one little-endian uint32) -> [n, 32] bit j of it, the 5th bit of element j."""
    bits = np.ascontiguousarray(qh).view("<u4")
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 8 six-bit scales and mins packed in 12 bytes -> ([n, 8], [n, 8])."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mn


def _k_lows(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: [n, 128] bytes -> [n, 256] low 4 bits; 32-byte chunk c holds sub-block 2c in
    its low nibbles and 2c + 1 in its high nibbles."""
    chunks = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(-1, 256)


def decode(qtype, data: np.ndarray, K: int):
    """The blocks of a GGUF tensor, data uint8 [rows, bytes per row], rows of K values:
    (bits, codes uint8 [rows, K], scales [rows, K/32], offsets [rows, K/32] or None, exact), or
    None for a type not kept."""
    if qtype not in BLOCK_BYTES:
        return None
    rows = data.shape[0]
    b = data.reshape(-1, BLOCK_BYTES[qtype])
    per_row = lambda a: a.reshape(rows, -1)
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        d = _f16(b[:, 0:2])
        if qtype == T.Q8_0:
            codes = (b[:, 2:].view(np.int8).astype(np.int32) + 128).astype(np.uint8)
            return 8, per_row(codes), per_row(d), None, True
        has_min = qtype in (T.Q4_1, T.Q5_1)
        m = _f16(b[:, 2:4]) if has_min else None
        at = 4 if has_min else 2
        if qtype in (T.Q4_0, T.Q4_1):
            codes = _nibbles(b[:, at:at + 16])
            return 4, per_row(codes), per_row(d), None if m is None else per_row(m), True
        codes = _nibbles(b[:, at + 4:at + 20]) | (_fifth_bits(b[:, at:at + 4]) << 4)  # Q5_0 / Q5_1: 0..31
        if m is None:
            return 8, per_row(codes + 112), per_row(d), None, True  # q - 16 + 128
        return 8, per_row(codes), per_row(d), per_row(m), True
    if qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _k_scales(b[:, 4:16])
        scales = d[:, None] * sc.astype(np.float32)  # exact: 11 x 6 significant bits
        offsets = -(dmin[:, None] * mn.astype(np.float32))
        if qtype == T.Q4_K:
            return 4, per_row(_k_lows(b[:, 16:144])), per_row(scales), per_row(offsets), True
        qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # bit j: sub-block j
        codes = _k_lows(b[:, 48:176]) | ((qh & 1).reshape(-1, 256) << 4)
        return 8, per_row(codes), per_row(scales), per_row(offsets), True
    # Q6_K: dequantize as ggml does, then int8 per 32 with scale max|w| / 127 (no level clipped:
    # every value within half an int8 step, 1/8 of a Q6_K step at most)
    from gguf import dequantize

    values = dequantize(data, qtype).reshape(rows, K // 32, 32)
    scales = np.abs(values).max(axis=2) / np.float32(127)
    safe = np.where(scales > 0, scales, 1)[:, :, None]
    codes = (np.clip(np.rint(values / safe), -127, 127) + 128).astype(np.uint8)
    return 8, codes.reshape(rows, K), scales.astype(np.float32), None, False


def _digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(row.tobytes(), digest_size=16).digest()


class GGUFBlocks:
    """The quantized 2-D tensors of a GGUF file, found by value: `find(W)` gives a [K, N] weight
    whose columns are rows of these tensors (as transformers' GGUF loader dequantizes them, in any
    order or permutation, concatenated: fused projections, a tied lm_head) in their own blocks,
    checked equal to W value for value, or None."""

    def __init__(self, path):
        from gguf import GGUFReader, dequantize

        self.tensors = []  # (bits, codes, scales, offsets, exact) per tensor, rows = output features
        self.rows = {}     # digest of a dequantized row -> (tensor index, row)
        for tensor in GGUFReader(str(path)).tensors:
            if len(tensor.shape) != 2 or int(tensor.shape[0]) % 32:
                continue
            K = int(tensor.shape[0])
            decoded = decode(tensor.tensor_type, np.asarray(tensor.data), K)
            if decoded is None:
                continue
            values = dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(-1, K)
            index = len(self.tensors)
            self.tensors.append(decoded)
            for r in range(values.shape[0]):
                self.rows.setdefault(_digest(values[r]), (index, r))

    def find(self, w: np.ndarray) -> BlockWeight | None:
        columns = np.ascontiguousarray(np.asarray(w, np.float32).T)  # [N, K]: one source row each
        hits = [self.rows.get(_digest(c)) for c in columns]
        if any(h is None for h in hits):
            return None
        tensor, row = (np.array(v) for v in zip(*hits))
        used = sorted(set(tensor.tolist()))
        bits = max(self.tensors[t][0] for t in used)
        asymmetric = any(self.tensors[t][3] is not None for t in used)
        K, N = w.shape
        codes, scales = np.zeros((N, K), np.uint8), np.zeros((N, K // 32), np.float32)
        offsets = np.zeros((N, K // 32), np.float32) if asymmetric else None
        exact = True
        for t in used:  # the tensors may differ in format: each is widened to the op's
            b, c, s, o, e = self.tensors[t]
            wide = BlockWeight(b, c, s, o, e).widened(bits, asymmetric)  # [rows, K] orientation
            take = tensor == t
            codes[take], scales[take] = wide.codes[row[take]], wide.scales[row[take]]
            if asymmetric:
                offsets[take] = wide.offsets[row[take]]
            exact &= e
        weight = BlockWeight(bits, codes.T.copy(), scales.T.copy(), None if offsets is None else offsets.T.copy(), exact)
        if exact and not np.array_equal(weight.dequantized(), w):
            weight.exact = False  # widened mixed formats may round a last bit differently
        return weight
