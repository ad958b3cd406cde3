"""Torch ops that export to single ONNX Runtime nodes.

Each op has a plain torch implementation (used by the export check and tests) and
a translation into one ONNX node, so the exported decoder has a few nodes a layer
instead of dozens (node dispatch, not arithmetic, dominates a one-token step):

- ``dflash::rms_norm``  -> ``SimplifiedLayerNormalization``;
- ``dflash::add_rms_norm`` (residual add, then RMSNorm) -> this project's ``ai.dflash.SkipRMSNorm``
  with ``custom`` attention (ORT's ``com.microsoft.SkipSimplifiedLayerNormalization`` hands even
  a few rows to its thread pool, ~0.5 ms an 8-row int4 verify), else that ORT op;
- ``dflash::rotary``    -> ``com.microsoft.RotaryEmbedding`` over cos/sin tables;
- ``dflash::swiglu`` (silu(gate) * up of a fused gate|up projection) -> ``ai.dflash.SwiGLU``, only
  emitted with ``custom`` (elsewhere the MLP stays Split + Sigmoid + Mul);
- ``dflash::cached_attention`` -> ``com.microsoft.GroupQueryAttention`` (``gqa``) or
  this project's ``ai.dflash.TreeAttention`` (``custom``).  Contract for both: query
  ``[1,S,H*D]``, key/value ``[1,S,Hkv*D]`` with rotary applied; caches ``[1,Hkv,C,D]``;
  ``past_len`` int64 scalar; ``mask [S,S]`` bool over the new rows.  Outputs: attention
  ``[1,S,H*D]`` and the caches with new rows written at ``past_len..past_len+S-1``.
  With ``custom`` the batch may be B > 1 (the batched data graph): every tensor's first
  dimension is B and ``past_len`` is ``[B]``, one length per sequence;
- ``dflash::packed_attention`` (projection output [q|k|v], rotary inside) ->
  ``ai.dflash.PackedTreeAttention``: one node for Split + 2 RotaryEmbedding + attention,
  used with ``custom`` for models without q/k norms;
- or ONNX ``Attention`` (opset 23, ``onnx``): the baseline.  Its present K/V is a new tensor of
  past+S rows, so the graph copies the whole cache every step to keep the same contract.
"""

from __future__ import annotations

import contextlib
import math

import onnx
import torch
from onnx.defs import OpSchema
from onnxscript import opset18 as op
from onnxscript import opset23
from onnxscript.values import Opset

ATTENTION_IMPLEMENTATIONS = ("custom", "gqa", "onnx")
MS_DOMAIN, DFLASH_DOMAIN = "com.microsoft", "ai.dflash"


# ---- torch side ------------------------------------------------------------

# The format the graph's KV cache stores rows in (dflash.ops.KV_DTYPES). The eager attention
# below rounds its new rows through it as TreeAttention does before attending to them, so the
# export check's reference computes what the graph does; `kv_stored_as` sets it.
_kv_dtype = "fp32"


@contextlib.contextmanager
def kv_stored_as(kv_dtype: str):
    global _kv_dtype
    before, _kv_dtype = _kv_dtype, kv_dtype
    try:
        yield
    finally:
        _kv_dtype = before


def as_stored(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """New K/V rows [B, S, Hkv*D] as the cache returns them once stored."""
    if _kv_dtype == "fp32":
        return rows
    from dflash.ops.reference import kv_load, kv_store

    heads = rows.reshape(*rows.shape[:-1], -1, head_dim).numpy()
    return torch.from_numpy(kv_load(kv_store(heads, _kv_dtype), _kv_dtype, head_dim)).reshape(rows.shape)


@torch.library.custom_op("dflash::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("dflash::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)"""
    total = x + residual
    return rms_norm(total, weight, eps), total


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("dflash::swiglu", mutates_args=())
def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dimension."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@swiglu.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@torch.library.custom_op("dflash::rotary", mutates_args=())
def rotary(x: torch.Tensor, position_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           num_heads: int) -> torch.Tensor:
    """Rotate-half rotary on x [B,S,N*D]; cos/sin tables [max_pos, D/2]."""
    xs = x.view(x.shape[0], x.shape[1], num_heads, -1)
    half = xs.shape[-1] // 2
    c, n = cos[position_ids].unsqueeze(2), sin[position_ids].unsqueeze(2)  # [B,S,1,D/2]
    x1, x2 = xs[..., :half], xs[..., half:]
    return torch.cat([x1 * c - x2 * n, x2 * c + x1 * n], dim=-1).reshape(x.shape)


@rotary.register_fake
def _(x, position_ids, cos, sin, num_heads):
    return torch.empty_like(x)


@torch.library.custom_op("dflash::cached_attention", mutates_args=())
def cached_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     key_cache: torch.Tensor, value_cache: torch.Tensor, past_len: torch.Tensor,
                     mask: torch.Tensor, scale: float, num_heads: int, kv_num_heads: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s, head_dim = query.shape[1], key_cache.shape[-1]
    key, value = as_stored(key, head_dim), as_stored(value, head_dim)
    pasts = past_len.reshape(-1).expand(query.shape[0])  # one length for all, or one per sequence
    present_k, present_v = key_cache.clone(), value_cache.clone()
    group = num_heads // kv_num_heads
    out = query.new_empty(query.shape)
    for b, past in enumerate(pasts.tolist()):
        present_k[b, :, past : past + s] = key[b].view(s, kv_num_heads, head_dim).transpose(0, 1)
        present_v[b, :, past : past + s] = value[b].view(s, kv_num_heads, head_dim).transpose(0, 1)
        k = present_k[b, :, : past + s].repeat_interleave(group, dim=0)  # [H, T, D]
        v = present_v[b, :, : past + s].repeat_interleave(group, dim=0)
        q = query[b].view(s, num_heads, head_dim).transpose(0, 1)  # [H, S, D]
        visible = torch.cat([torch.ones(s, past, dtype=torch.bool), mask], dim=1)
        scores = ((q @ k.transpose(1, 2)) * scale).masked_fill(~visible, float("-inf"))
        out[b] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(s, num_heads * head_dim)  # [S, H*D]
    return out, present_k, present_v


@cached_attention.register_fake
def _(query, key, value, key_cache, value_cache, past_len, mask, scale, num_heads, kv_num_heads):
    return torch.empty_like(query), torch.empty_like(key_cache), torch.empty_like(value_cache)


@torch.library.custom_op("dflash::packed_attention", mutates_args=())
def packed_attention(qkv: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, past_len: torch.Tensor,
                     mask: torch.Tensor, position_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     scale: float, num_heads: int, kv_num_heads: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cached_attention of the packed projection output [q | k | v], rotary applied here."""
    d = key_cache.shape[-1]
    q, k, v = qkv.split([num_heads * d, kv_num_heads * d, kv_num_heads * d], dim=-1)
    q, k = rotary(q, position_ids, cos, sin, num_heads), rotary(k, position_ids, cos, sin, kv_num_heads)
    return cached_attention(q, k, v, key_cache, value_cache, past_len, mask, scale, num_heads, kv_num_heads)


@packed_attention.register_fake
def _(qkv, key_cache, value_cache, past_len, mask, position_ids, cos, sin, scale, num_heads, kv_num_heads):
    out = qkv.new_empty(qkv.shape[0], qkv.shape[1], num_heads * key_cache.shape[-1])
    return out, torch.empty_like(key_cache), torch.empty_like(value_cache)


# ---- ONNX side -------------------------------------------------------------

_F = OpSchema.FormalParameter
_OPT = OpSchema.FormalParameterOption.Optional
_INT, _FLOAT = OpSchema.AttrType.INT, OpSchema.AttrType.FLOAT


def _schema(name, domain, inputs, outputs, types, attributes):
    """Teach onnx an ORT contrib op's signature so onnxscript can emit it."""
    if not onnx.defs.has(name, domain):
        onnx.defs.register_schema(OpSchema(
            name, domain, 1, inputs=inputs, outputs=outputs, type_constraints=types,
            attributes=[OpSchema.Attribute(a, t, "") for a, t in attributes]))


_schema("SimplifiedLayerNormalization", "", [_F("X", "T"), _F("scale", "T")], [_F("Y", "T")],
        [("T", ["tensor(float)"], "")], [("axis", _INT), ("epsilon", _FLOAT)])
_schema("SkipSimplifiedLayerNormalization", MS_DOMAIN,
        [_F("input", "T"), _F("skip", "T"), _F("gamma", "T")],
        [_F("output", "T"), _F("mean", "U", param_option=_OPT), _F("inv_std_var", "U", param_option=_OPT),
         _F("input_skip_bias_sum", "T", param_option=_OPT)],
        [("T", ["tensor(float)"], ""), ("U", ["tensor(float)"], "")], [("epsilon", _FLOAT)])
_schema("SkipRMSNorm", DFLASH_DOMAIN, [_F("input", "T"), _F("skip", "T"), _F("gamma", "T")],
        [_F("output", "T"), _F("sum", "T")], [("T", ["tensor(float)"], "")], [("epsilon", _FLOAT)])
_schema("SwiGLU", DFLASH_DOMAIN, [_F("input", "T")], [_F("output", "T")], [("T", ["tensor(float)"], "")], [])
_schema("RotaryEmbedding", MS_DOMAIN,
        [_F("input", "T"), _F("position_ids", "M"), _F("cos_cache", "T"), _F("sin_cache", "T")],
        [_F("output", "T")], [("T", ["tensor(float)"], ""), ("M", ["tensor(int64)"], "")],
        [("interleaved", _INT), ("num_heads", _INT), ("rotary_embedding_dim", _INT), ("scale", _FLOAT)])
_ATTENTION_ATTRS = [("num_heads", _INT), ("kv_num_heads", _INT), ("scale", _FLOAT)]
_schema("GroupQueryAttention", MS_DOMAIN,
        [_F("query", "T"), _F("key", "T"), _F("value", "T"),
         _F("past_key", "T", param_option=_OPT), _F("past_value", "T", param_option=_OPT),
         _F("seqlens_k", "M"), _F("total_sequence_length", "M"),
         _F("cos_cache", "T", param_option=_OPT), _F("sin_cache", "T", param_option=_OPT),
         _F("position_ids", "P", param_option=_OPT), _F("attention_bias", "T", param_option=_OPT)],
        [_F("output", "T"), _F("present_key", "T"), _F("present_value", "T")],
        [("T", ["tensor(float)"], ""), ("M", ["tensor(int32)"], ""), ("P", ["tensor(int64)"], "")],
        _ATTENTION_ATTRS + [("causal", _INT)])
_CACHE_TYPES = ("C", ["tensor(float)", "tensor(float16)", "tensor(uint8)"], "")  # the KV formats
_schema("TreeAttention", DFLASH_DOMAIN,
        [_F("query", "T"), _F("key", "T"), _F("value", "T"), _F("key_cache", "C"),
         _F("value_cache", "C"), _F("past_len", "I"), _F("mask", "B")],
        [_F("output", "T"), _F("present_key", "C"), _F("present_value", "C")],
        [("T", ["tensor(float)"], ""), _CACHE_TYPES, ("I", ["tensor(int64)"], ""), ("B", ["tensor(bool)"], "")],
        _ATTENTION_ATTRS)

_schema("PackedTreeAttention", DFLASH_DOMAIN,
        [_F("qkv", "T"), _F("key_cache", "C"), _F("value_cache", "C"), _F("past_len", "I"), _F("mask", "B"),
         _F("position_ids", "I"), _F("cos_cache", "T"), _F("sin_cache", "T")],
        [_F("output", "T"), _F("present_key", "C"), _F("present_value", "C")],
        [("T", ["tensor(float)"], ""), _CACHE_TYPES, ("I", ["tensor(int64)"], ""), ("B", ["tensor(bool)"], "")],
        _ATTENTION_ATTRS)

_onnx = Opset("", 1)  # SimplifiedLayerNormalization is an ORT op in the default domain
_ms = Opset(MS_DOMAIN, 1)
_dflash = Opset(DFLASH_DOMAIN, 1)


def _rms_norm(x, weight, eps: float):
    return _onnx.SimplifiedLayerNormalization(x, weight, axis=-1, epsilon=eps)


def _add_rms_norm(x, residual, weight, eps: float):
    out, _, _, total = _ms.SkipSimplifiedLayerNormalization(x, residual, weight, epsilon=eps)
    return out, total


def _skip_rms_norm(x, residual, weight, eps: float):
    return _dflash.SkipRMSNorm(x, residual, weight, epsilon=eps)


def _swiglu(x):
    return _dflash.SwiGLU(x)


def _rotary(x, position_ids, cos, sin, num_heads: int):
    return _ms.RotaryEmbedding(x, position_ids, cos, sin, interleaved=0, num_heads=num_heads)


def _gqa(query, key, value, key_cache, value_cache, past_len, mask,
         scale: float, num_heads: int, kv_num_heads: int):
    # With causal=0, GQA's only mask is attention_bias [1,1,S,past+S]: 0 where a new row may
    # look, -inf where the mask forbids it (so tree and bidirectional masks work too).  Everything here derives from
    # (mask, past_len) alone, so ORT's common-subexpression pass builds it once, not per layer.
    s = op.Shape(mask, start=0, end=1)
    past = op.Reshape(past_len, op.Constant(value_ints=[1]))
    total = op.Add(past, s)
    seqlens_k = op.Cast(op.Sub(total, op.Constant(value_ints=[1])), to=onnx.TensorProto.INT32)
    total_len = op.Cast(op.Squeeze(total), to=onnx.TensorProto.INT32)
    seen = op.ConstantOfShape(op.Concat(s, past, axis=0),
                              value=onnx.helper.make_tensor("zero", onnx.TensorProto.FLOAT, [1], [0.0]))
    new = op.Where(mask, op.Constant(value_float=0.0), op.Constant(value_float=-math.inf))
    bias = op.Unsqueeze(op.Concat(seen, new, axis=1), op.Constant(value_ints=[0, 1]))
    return _ms.GroupQueryAttention(query, key, value, key_cache, value_cache, seqlens_k, total_len,
                                   None, None, None, bias,
                                   num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale,
                                   causal=0)


def _onnx_attention(query, key, value, key_cache, value_cache, past_len, mask,
                    scale: float, num_heads: int, kv_num_heads: int):
    zero, rows = op.Constant(value_ints=[0]), op.Constant(value_ints=[2])
    past = op.Reshape(past_len, op.Constant(value_ints=[1]))
    end = op.Add(past, op.Shape(mask, start=0, end=1))
    capacity = op.Shape(key_cache, start=2, end=3)
    seen = op.Expand(op.Constant(value_ints=[1]), op.Concat(op.Shape(mask, start=0, end=1), past, axis=0))
    attn_mask = op.Concat(op.Cast(seen, to=onnx.TensorProto.BOOL), mask, axis=1)
    out, present_k, present_v, _ = opset23.Attention(
        query, key, value, attn_mask, op.Slice(key_cache, zero, past, rows),
        op.Slice(value_cache, zero, past, rows), is_causal=0, q_num_heads=num_heads,
        kv_num_heads=kv_num_heads, scale=scale)
    # back into the fixed-capacity buffers: a full copy, which is this baseline's cost
    key_out = op.Concat(present_k, op.Slice(key_cache, end, capacity, rows), axis=2)
    value_out = op.Concat(present_v, op.Slice(value_cache, end, capacity, rows), axis=2)
    return out, key_out, value_out


def _tree_attention(query, key, value, key_cache, value_cache, past_len, mask,
                    scale: float, num_heads: int, kv_num_heads: int):
    return _dflash.TreeAttention(query, key, value, key_cache, value_cache, past_len, mask,
                                 num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale)


def _packed_tree_attention(qkv, key_cache, value_cache, past_len, mask, position_ids, cos, sin,
                           scale: float, num_heads: int, kv_num_heads: int):
    return _dflash.PackedTreeAttention(qkv, key_cache, value_cache, past_len, mask, position_ids, cos, sin,
                                       num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale)


def translation_table(attention: str) -> dict:
    """The `custom_translation_table` for torch.onnx.export."""
    if attention not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {attention!r}; "
                         f"choose one of {ATTENTION_IMPLEMENTATIONS}")
    return {
        torch.ops.dflash.rms_norm.default: _rms_norm,
        torch.ops.dflash.add_rms_norm.default: _skip_rms_norm if attention == "custom" else _add_rms_norm,
        torch.ops.dflash.rotary.default: _rotary,
        torch.ops.dflash.cached_attention.default: {
            "gqa": _gqa, "custom": _tree_attention, "onnx": _onnx_attention}[attention],
        # only emitted with `custom` (see target.DecoderLayer)
        torch.ops.dflash.packed_attention.default: _packed_tree_attention,
        torch.ops.dflash.swiglu.default: _swiglu,
    }
