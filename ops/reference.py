"""NumPy reference of the TreeAttention op (same semantics as tree_attention.cc), for tests.

Shapes (batch is always 1):
    q        [1, S, H*D]        query, rotary already applied
    k, v     [1, S_kv, Hkv*D]   the new key/value rows, rotary already applied to k
    k_cache  [1, Hkv, C, D]     cache buffers; rows < past_len are valid
    v_cache  [1, Hkv, C, D]
    past_len int, or an int array of shape [] or [1]
    mask     bool [S, S_kv]     query row i may attend new row j iff mask[i, j]

Returns (out [1, S, H*D], present_k, present_v), all float32. The presents are copies of the caches
with the new rows written at rows past_len .. past_len+S_kv-1. Query row i, head h (kv head
h // (H // Hkv)) attends to every cache row < past_len and to the new rows its mask row allows;
a row that sees nothing gets zeros.
"""

from __future__ import annotations

import numpy as np


def tree_attention(q, k, v, k_cache, v_cache, past_len, mask, scale, num_heads, kv_num_heads):
    q = np.asarray(q, dtype=np.float32)
    k = np.asarray(k, dtype=np.float32)
    v = np.asarray(v, dtype=np.float32)
    mask = np.asarray(mask)
    past = int(np.asarray(past_len).reshape(-1)[0])
    H, Hkv = int(num_heads), int(kv_num_heads)
    if H <= 0 or Hkv <= 0 or H % Hkv:
        raise ValueError(f"num_heads {H} must be a positive multiple of kv_num_heads {Hkv}")
    _, S, qw = q.shape
    _, Skv, kw = k.shape
    if kw % Hkv:
        raise ValueError(f"key width {kw} is not a multiple of kv_num_heads {Hkv}")
    D = kw // Hkv
    if qw != H * D or v.shape != k.shape:
        raise ValueError("query/value widths do not match the heads")
    C = k_cache.shape[2]
    if k_cache.shape != (1, Hkv, C, D) or v_cache.shape != k_cache.shape:
        raise ValueError("cache shape mismatch")
    if past < 0 or past + Skv > C:
        raise ValueError(f"past_len {past} + {Skv} new rows exceeds cache capacity {C}")
    if mask.dtype != np.bool_ or mask.shape != (S, Skv):
        raise ValueError("mask must be bool [S, S_kv]")

    present_k = np.array(k_cache, dtype=np.float32, copy=True)
    present_v = np.array(v_cache, dtype=np.float32, copy=True)
    present_k[0, :, past:past + Skv, :] = k.reshape(Skv, Hkv, D).transpose(1, 0, 2)
    present_v[0, :, past:past + Skv, :] = v.reshape(Skv, Hkv, D).transpose(1, 0, 2)

    T = past + Skv
    visible = np.concatenate([np.ones((S, past), dtype=bool), mask], axis=1)  # [S, T]
    G = H // Hkv
    qh = q.reshape(S, H, D).astype(np.float64)
    out = np.zeros((S, H, D), dtype=np.float64)
    for h in range(H):
        g = h // G
        keys = present_k[0, g, :T].astype(np.float64)
        vals = present_v[0, g, :T].astype(np.float64)
        scores = (qh[:, h, :] @ keys.T) * float(scale)  # [S, T]
        scores = np.where(visible, scores, -np.inf)
        row_max = scores.max(axis=1, keepdims=True) if T else np.zeros((S, 1))
        row_max = np.where(np.isfinite(row_max), row_max, 0.0)
        p = np.where(visible, np.exp(scores - row_max), 0.0)
        denom = p.sum(axis=1, keepdims=True)
        p = np.divide(p, denom, out=np.zeros_like(p), where=denom > 0)
        out[:, h, :] = p @ vals
    return out.reshape(1, S, H * D).astype(np.float32), present_k, present_v


def rotate_half(x, cos, sin):
    """Rotary, rotate-half layout: x [..., D] with cos/sin [..., D/2] broadcast over heads."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(np.float32)


def packed_tree_attention(qkv, k_cache, v_cache, past_len, mask, position_ids, cos, sin, scale, num_heads,
                          kv_num_heads):
    """PackedTreeAttention: qkv [1,S,(H+2Hkv)*D] split into q, k, v; rotary on q and k at
    position_ids (tables cos/sin [P, D/2]); then tree_attention."""
    H, Hkv = int(num_heads), int(kv_num_heads)
    _, S, W = qkv.shape
    D = W // (H + 2 * Hkv)
    pos = np.asarray(position_ids).reshape(S)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]  # [S, 1, D/2]
    q = rotate_half(qkv[0, :, :H * D].reshape(S, H, D), c, s).reshape(1, S, H * D)
    k = rotate_half(qkv[0, :, H * D:(H + Hkv) * D].reshape(S, Hkv, D), c, s).reshape(1, S, Hkv * D)
    v = qkv[:, :, (H + Hkv) * D:]
    return tree_attention(q, k, v, k_cache, v_cache, past_len, mask, scale, H, Hkv)


def causal_mask(S: int) -> np.ndarray:
    """Row i sees new rows 0..i."""
    return np.tril(np.ones((S, S), dtype=bool))


def full_mask(S: int) -> np.ndarray:
    """Every row sees every new row (bidirectional, e.g. the DFlash block)."""
    return np.ones((S, S), dtype=bool)


def tree_mask(parents) -> np.ndarray:
    """Ancestor-or-self mask of a tree given as a parent list (-1 for a root).

    Parents must come before their children (parents[i] < i), as the verify step lays them out.
    """
    n = len(parents)
    m = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parents):
        p = int(p)
        if p >= i or p < -1:
            raise ValueError(f"parents[{i}] = {p}: a parent must come before its child")
        m[i, i] = True
        if p >= 0:
            m[i] |= m[p]
    return m


# ---- MatMulQ4 / MatMulQ8 (matmul_q4.cc, matmul_q8.cc): rows that round alike for any row count --
#
# Both store per block of 32 rows (along K) and column a code u, a scale and, for asymmetric blocks,
# an offset: W = (u - zero) * scale (symmetric, zero 8 or 128) or W = u * scale + offset.

Q4_BLOCK, Q4_TILE = 32, 16
Q8_TILE_BYTES = 512
ZERO = {4: 8, 8: 128}  # the symmetric formats' zero points


def tile_params(p, N):
    """Per-block parameters [KB, N] (scales or offsets) as the ops take them: [T, KB, 16], padding
    columns 0."""
    p = np.asarray(p, dtype=np.float32)
    KB = p.shape[0]
    T = -(-N // Q4_TILE)
    out = np.zeros((KB, T * Q4_TILE), np.float32)
    out[:, :N] = p
    return np.ascontiguousarray(out.reshape(KB, T, Q4_TILE).transpose(1, 0, 2))


def tile_codes(u, bits, pad=0):
    """Codes u [K, N] (0..15 or 0..255) in the op's byte layout: uint8 [T, K/32, 256 or 512]; padding
    columns hold `pad`."""
    K, N = u.shape
    T, KB = -(-N // Q4_TILE), K // Q4_BLOCK
    up = np.full((K, T * Q4_TILE), pad, np.uint8)
    up[:, :N] = u
    blocks = up.reshape(KB, Q4_BLOCK, T, Q4_TILE).transpose(2, 0, 1, 3)  # [T, KB, 32, 16]
    if bits == 8:  # k = 4*g + i  ->  byte 64*g + 4*c + i
        b = blocks.reshape(T, KB, 8, 4, Q4_TILE).transpose(0, 1, 2, 4, 3)  # [T, KB, g, c, i]
        return np.ascontiguousarray(b).reshape(T, KB, Q8_TILE_BYTES)
    # k = 16*hi + 4*c4 + i  ->  byte 64*c4 + 4*c + i, nibble hi
    b = blocks.reshape(T, KB, 2, 4, 4, Q4_TILE).transpose(0, 1, 2, 3, 5, 4)  # [T, KB, hi, c4, c, i]
    return np.ascontiguousarray(b[:, :, 0] | (b[:, :, 1] << 4)).reshape(T, KB, 256).astype(np.uint8)


def untile_codes(weight, bits, N):
    """The codes u [K, N] (int64) of a packed weight: the inverse of tile_codes."""
    T, KB, _ = weight.shape
    if bits == 8:
        u = weight.reshape(T, KB, 8, Q4_TILE, 4).transpose(0, 1, 2, 4, 3)  # [T, KB, g, i, c]
    else:
        b = weight.reshape(T, KB, 4, Q4_TILE, 4)  # [T, KB, c4, c, i]
        u = np.stack([b & 0x0F, b >> 4], axis=2).transpose(0, 1, 2, 3, 5, 4)  # [T, KB, hi, c4, i, c]
    u = u.reshape(T, KB, Q4_BLOCK, Q4_TILE).astype(np.int64)
    return u.transpose(1, 2, 0, 3).reshape(KB * Q4_BLOCK, T * Q4_TILE)[:, :N]


def dequantize(weight, scales, N, bits, offsets=None):
    """The dequantized W [K, N] that the op multiplies by, in float32 as the source formats
    dequantize: (u - zero) * scale, or u * scale + offset (each rounded once). Scales and offsets
    may be float16 (widened exactly)."""
    u = untile_codes(weight, bits, N)
    scales = np.asarray(scales, np.float32)
    offsets = None if offsets is None else np.asarray(offsets, np.float32)
    per_row = lambda p: np.repeat(p.transpose(1, 0, 2).reshape(p.shape[1], -1)[:, :N], Q4_BLOCK, axis=0)
    if offsets is None:
        return ((u - ZERO[bits]).astype(np.float32) * per_row(scales)).astype(np.float32)
    return (u.astype(np.float32) * per_row(scales) + per_row(offsets)).astype(np.float32)


def symmetric_codes(w, bits, half=False):
    """Round-to-nearest symmetric blocks of 32 rows per column: the scale maps the block's
    largest-magnitude weight to the lowest level (-8 or -128, as ORT's symmetric MatMulNBits does);
    `half`: the scale rounded to float16 first (as GGUF's Q8_0 / Q4_0 store it), the codes rounded
    against it. Returns (u uint8 [K, N] with the zero point added, scales [KB, N])."""
    w = np.asarray(w, dtype=np.float32)
    K, N = w.shape
    if K % Q4_BLOCK:
        raise ValueError(f"K = {K} is not a multiple of {Q4_BLOCK}")
    zero = ZERO[bits]
    blocks = w.reshape(K // Q4_BLOCK, Q4_BLOCK, N)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None, :], axis=1)[:, 0]
    scale = (extreme / np.float32(-zero)).astype(np.float32)  # [KB, N]
    if half:
        scale = scale.astype(np.float16).astype(np.float32)
    safe = np.where(scale != 0, scale, 1.0)
    u = np.clip(np.rint(blocks / safe[:, None, :]), -zero, zero - 1) + zero
    return u.reshape(K, N).astype(np.uint8), scale


def pack_q4(w):
    """Quantize W [K, N] (K a multiple of 32) to the MatMulQ4 layout with symmetric round-to-nearest
    blocks (symmetric_codes). Returns (weight uint8 [T, K/32, 256], scales float32 [T, K/32, 16])
    with T = ceil(N/16); padding columns are zero weights (u = 8) with scale 0."""
    u, scale = symmetric_codes(w, 4)
    return tile_codes(u, 4, pad=8), tile_params(scale, u.shape[1])


def pack_q8(w):
    """As pack_q4, for the MatMulQ8 layout (weight uint8 [T, K/32, 512]); padding columns are zero
    weights (u = 128) with scale 0."""
    u, scale = symmetric_codes(w, 8)
    return tile_codes(u, 8, pad=128), tile_params(scale, u.shape[1])


def minmax_codes(w, bits):
    """Round-to-nearest asymmetric blocks of 32 rows per column, as GGUF's reference Q4_1 quantizer:
    scale (max - min) / (2^bits - 1), offset min. Returns (u uint8 [K, N], scales [KB, N],
    offsets [KB, N])."""
    w = np.asarray(w, dtype=np.float32)
    K, N = w.shape
    blocks = w.reshape(K // Q4_BLOCK, Q4_BLOCK, N)
    low, high = blocks.min(axis=1), blocks.max(axis=1)
    scale = ((high - low) / np.float32(2 ** bits - 1)).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0)
    u = np.clip(np.rint((blocks - low[:, None, :]) / safe[:, None, :]), 0, 2 ** bits - 1)
    return u.reshape(K, N).astype(np.uint8), scale, low.astype(np.float32)


def pack_asymmetric(w, bits):
    """W [K, N] as minmax_codes in the MatMulQ4 (bits 4) or MatMulQ8 (bits 8) layout: (weight,
    scales, offsets), each [T, K/32, ...]."""
    u, scale, offset = minmax_codes(w, bits)
    N = u.shape[1]
    return tile_codes(u, bits), tile_params(scale, N), tile_params(offset, N)


def unpack_q4(weight, scales, N, offsets=None):
    """The dequantized W [K, N] that MatMulQ4 multiplies by (for tests and error estimates)."""
    return dequantize(weight, scales, N, 4, offsets)


def unpack_q8(weight, scales, N, offsets=None):
    """The dequantized W [K, N] that MatMulQ8 multiplies by."""
    return dequantize(weight, scales, N, 8, offsets)


def quantize_activations(a):
    """Activations [..., K] as the quantized MatMul ops quantize them (ops/quantized_matmul.cc): per block
    of 32, q = round-half-even(a * (127 / max|a|)) in float32 and sa = max|a| / 127. Returns
    (q int64 [M, K/32, 32], sa float32 [M, K/32])."""
    a = np.asarray(a, dtype=np.float32)
    x = a.reshape(-1, a.shape[-1] // Q4_BLOCK, Q4_BLOCK)
    amax = np.abs(x).max(axis=2)                            # [M, KB]
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(x * inv[:, :, None]), -127, 127).astype(np.int64)
    return q, (amax / np.float32(127)).astype(np.float32)


def fma32(a, b, c):
    """float32 fma: the float64 product of two float32s is exact, so one rounding, as the ops."""
    return (np.asarray(a, np.float64) * b + c).astype(np.float32)


def accumulate_blocks(dots, sa, scales, offsets=None, totals=None):
    """y [M, T*16] = sum over blocks b in order of fma(float(dots[:, b]), sa[:, b] * scale_b, y)
    from 0, then (asymmetric) y = fma(offset_b, totals[:, b], y), in float32 as the ops do (dots:
    exact integer dots [M, KB, T*16]; totals = sa * sum(q) [M, KB])."""
    T, KB, _ = scales.shape
    flat = lambda p: p.transpose(1, 0, 2).reshape(KB, T * Q4_TILE)
    sb = flat(scales)
    ob = None if offsets is None else flat(offsets)
    y = np.zeros((dots.shape[0], T * Q4_TILE), np.float32)
    for b in range(KB):
        s = (sa[:, b:b + 1] * sb[b][None, :]).astype(np.float32)
        y = fma32(dots[:, b].astype(np.float32), s, y)
        if ob is not None:
            y = fma32(ob[b][None, :], totals[:, b:b + 1], y)
    return y


def split_rows(a):
    """split_activations: each row a [M, K] followed by its residual a - sa * q after int8
    quantization (in float64, where sa * q is exact, rounded to float32 once): [2M, K]."""
    a = np.asarray(a, dtype=np.float32).reshape(-1, a.shape[-1])
    q, sa = quantize_activations(a)
    residual = (a.astype(np.float64) - (sa[:, :, None].astype(np.float64) * q).reshape(a.shape)).astype(np.float32)
    return np.stack([a, residual], axis=1).reshape(-1, a.shape[-1])


def quantized_matmul(a, weight, scales, N, bits, offsets=None, split=False):
    """MatMulQ4 (bits 4) or MatMulQ8 (bits 8) in numpy, bit for bit: a [..., K] float32 -> [..., N]
    (scales and offsets float32 or float16; `split`: the split_activations attribute)."""
    a = np.asarray(a, dtype=np.float32)
    if split:
        y = quantized_matmul(split_rows(a), weight, scales, N, bits, offsets).reshape(-1, 2, N)
        return (y[:, 0] + y[:, 1]).reshape(*a.shape[:-1], N)
    scales = np.asarray(scales, np.float32)
    offsets = None if offsets is None else np.asarray(offsets, np.float32)
    T, KB, _ = weight.shape
    q, sa = quantize_activations(a)
    u = untile_codes(weight, bits, T * Q4_TILE).reshape(KB, Q4_BLOCK, T * Q4_TILE)
    zero = 0 if offsets is not None else ZERO[bits]
    dots = np.einsum("mbk,bkn->mbn", q, u) - zero * q.sum(axis=2)[:, :, None]  # exact ints
    totals = (sa * q.sum(axis=2).astype(np.float32)).astype(np.float32)
    return accumulate_blocks(dots, sa, scales, offsets, totals)[:, :N].reshape(*a.shape[:-1], N)


def matmul_q4(a, weight, scales, N, offsets=None):
    """MatMulQ4 in numpy, bit for bit."""
    return quantized_matmul(a, weight, scales, N, 4, offsets)


def matmul_q8(a, weight, scales, N, offsets=None):
    """MatMulQ8 in numpy, bit for bit."""
    return quantized_matmul(a, weight, scales, N, 8, offsets)


def skip_rms_norm(x, skip, gamma, epsilon):
    """SkipRMSNorm in float64: (output, sum) with sum = x + skip."""
    total = x.astype(np.float64) + skip
    inv = 1.0 / np.sqrt(np.mean(total * total, axis=-1, keepdims=True) + epsilon)
    return (total * inv * gamma).astype(np.float32), (x + skip).astype(np.float32)


def swiglu(x):
    """SwiGLU in float64: silu(x[..., :I]) * x[..., I:]."""
    gate, up = np.split(x.astype(np.float64), 2, axis=-1)
    return (gate / (1.0 + np.exp(-gate)) * up).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# KV cache formats (kv_format.h): rows of D values as TreeAttention stores them.

from dflash.ops import KV_INT8_BLOCK as Q8_BLOCK  # noqa: E402
from dflash.ops import kv_row_width  # noqa: E402,F401  (the tests' import)


def kv_store(x, kv_dtype: str) -> np.ndarray:
    """Float rows [..., D] in the cache format: fp16 rounded to nearest even; int8 per block of 32
    values q = rint(x / s), s = max|x| / 127 (float32), the scales' bytes after the D codes."""
    x = np.asarray(x, dtype=np.float32)
    if kv_dtype == "fp32":
        return x.copy()
    if kv_dtype == "fp16":
        return x.astype(np.float16)
    D = x.shape[-1]
    codes, scales = [], []
    for d0 in range(0, D, Q8_BLOCK):
        block = x[..., d0:d0 + Q8_BLOCK]
        s = (np.abs(block).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(s > 0, np.rint(block / s), 0).clip(-127, 127)
        codes.append(q.astype(np.int8).view(np.uint8))
        scales.append(s)
    return np.concatenate(codes + [np.concatenate(scales, axis=-1).view(np.uint8)], axis=-1)


def kv_load(stored, kv_dtype: str, D: int) -> np.ndarray:
    """Cache rows back to float32 rows [..., D], as the op widens them."""
    stored = np.asarray(stored)
    if kv_dtype != "int8":
        return stored.astype(np.float32)
    codes = stored[..., :D].view(np.int8).astype(np.float32)
    scales = np.ascontiguousarray(stored[..., D:]).view(np.float32)
    return codes * np.repeat(scales, Q8_BLOCK, axis=-1)[..., :D]
