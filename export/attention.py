"""Cached, masked attention as one torch op that exports to one ONNX node.

The target graph calls `dflash::cached_attention` in every layer.  In torch it
runs a plain reference; in the ONNX graph it becomes one node of the attention
implementation chosen at export:

- ``gqa``: ORT's ``com.microsoft.GroupQueryAttention`` with ``attention_bias``,
  in shared-buffer mode (the runtime binds past and present K/V to one buffer);
- ``custom``: this project's ``ai.dflash.TreeAttention`` (ops/).

Contract (both): query ``[1,S,H*D]``, key/value ``[1,S,Hkv*D]`` with rotary
applied; K/V caches ``[1,Hkv,C,D]``; ``past_len`` (int64 scalar); ``mask``
``[S,S]`` bool for the new rows.  Outputs: attention ``[1,S,H*D]`` and the two
caches with the new rows written at ``past_len..past_len+S-1``.
"""

from __future__ import annotations

import math

import onnx
import torch
from onnx.defs import OpSchema
from onnxscript import opset18 as op
from onnxscript.values import Opset

IMPLEMENTATIONS = ("gqa", "custom")


@torch.library.custom_op("dflash::cached_attention", mutates_args=())
def cached_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    past_len: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    num_heads: int,
    kv_num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    past, s = int(past_len), query.shape[1]
    head_dim = key_cache.shape[-1]
    present_k, present_v = key_cache.clone(), value_cache.clone()
    present_k[0, :, past : past + s] = key[0].view(s, kv_num_heads, head_dim).transpose(0, 1)
    present_v[0, :, past : past + s] = value[0].view(s, kv_num_heads, head_dim).transpose(0, 1)
    group = num_heads // kv_num_heads
    k = present_k[0, :, : past + s].repeat_interleave(group, dim=0)  # [H, T, D]
    v = present_v[0, :, : past + s].repeat_interleave(group, dim=0)
    q = query[0].view(s, num_heads, head_dim).transpose(0, 1)  # [H, S, D]
    visible = torch.cat([torch.ones(s, past, dtype=torch.bool), mask], dim=1)
    scores = (q @ k.transpose(1, 2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [H, S, D]
    return out.transpose(0, 1).reshape(1, s, num_heads * head_dim), present_k, present_v


@cached_attention.register_fake
def _(query, key, value, key_cache, value_cache, past_len, mask, scale, num_heads, kv_num_heads):
    return torch.empty_like(query), torch.empty_like(key_cache), torch.empty_like(value_cache)


def hf_attention(module, query, key, value, attention_mask, scaling=None, dflash_io=None, **_):
    """An HF attention function (AttentionInterface) that routes to the cached op.

    HF hands us query ``[1,H,S,D]`` and key/value ``[1,Hkv,S,D]`` after rotary;
    ``dflash_io`` carries this forward's caches, past length and tree mask.
    """
    _, n_heads, s, d = query.shape
    n_kv = key.shape[1]
    q = query.transpose(1, 2).reshape(1, s, n_heads * d)
    k = key.transpose(1, 2).reshape(1, s, n_kv * d)
    v = value.transpose(1, 2).reshape(1, s, n_kv * d)
    i = module.layer_idx
    out, pk, pv = cached_attention(
        q, k, v, dflash_io.key_caches[i], dflash_io.value_caches[i],
        dflash_io.past_len, dflash_io.mask, float(scaling), n_heads, n_kv,
    )
    dflash_io.presents[i] = (pk, pv)
    return out.view(1, s, n_heads, d), None


class CacheIO:
    """What one target forward passes to every layer's attention."""

    def __init__(self, key_caches, value_caches, past_len, mask):
        self.key_caches, self.value_caches = key_caches, value_caches
        self.past_len, self.mask = past_len, mask
        self.presents = [None] * len(key_caches)


# ---- ONNX side -------------------------------------------------------------

MS_DOMAIN, DFLASH_DOMAIN = "com.microsoft", "ai.dflash"
_F = OpSchema.FormalParameter
_OPTIONAL = OpSchema.FormalParameterOption.Optional


def _register_schemas() -> None:
    """Teach onnx the two non-standard ops so onnxscript can emit them."""
    if not onnx.defs.has("GroupQueryAttention", MS_DOMAIN):
        inputs = [_F("query", "T"), _F("key", "T"), _F("value", "T"),
                  _F("past_key", "T", param_option=_OPTIONAL),
                  _F("past_value", "T", param_option=_OPTIONAL),
                  _F("seqlens_k", "M"), _F("total_sequence_length", "M"),
                  _F("cos_cache", "T", param_option=_OPTIONAL),
                  _F("sin_cache", "T", param_option=_OPTIONAL),
                  _F("position_ids", "P", param_option=_OPTIONAL),
                  _F("attention_bias", "T", param_option=_OPTIONAL)]
        onnx.defs.register_schema(OpSchema(
            "GroupQueryAttention", MS_DOMAIN, 1,
            inputs=inputs,
            outputs=[_F("output", "T"), _F("present_key", "T"), _F("present_value", "T")],
            type_constraints=[("T", ["tensor(float)"], ""), ("M", ["tensor(int32)"], ""),
                              ("P", ["tensor(int64)"], "")],
            attributes=[OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, ""),
                        OpSchema.Attribute("kv_num_heads", OpSchema.AttrType.INT, ""),
                        OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "")],
        ))
    if not onnx.defs.has("TreeAttention", DFLASH_DOMAIN):
        onnx.defs.register_schema(OpSchema(
            "TreeAttention", DFLASH_DOMAIN, 1,
            inputs=[_F("query", "T"), _F("key", "T"), _F("value", "T"),
                    _F("key_cache", "T"), _F("value_cache", "T"),
                    _F("past_len", "I"), _F("mask", "B")],
            outputs=[_F("output", "T"), _F("present_key", "T"), _F("present_value", "T")],
            type_constraints=[("T", ["tensor(float)"], ""), ("I", ["tensor(int64)"], ""),
                              ("B", ["tensor(bool)"], "")],
            attributes=[OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, ""),
                        OpSchema.Attribute("kv_num_heads", OpSchema.AttrType.INT, ""),
                        OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "")],
        ))


_register_schemas()
_ms = Opset(MS_DOMAIN, 1)
_dflash = Opset(DFLASH_DOMAIN, 1)


def _gqa(query, key, value, key_cache, value_cache, past_len, mask,
         scale: float, num_heads: int, kv_num_heads: int):
    # GQA masks causally by itself and adds attention_bias [1,1,S,past+S]:
    # 0 where a new row may look, -inf where the tree mask forbids it.
    s = op.Shape(query, start=1, end=2)
    past = op.Reshape(past_len, op.Constant(value_ints=[1]))
    total = op.Add(past, s)
    seqlens_k = op.Cast(op.Sub(total, op.Constant(value_ints=[1])), to=onnx.TensorProto.INT32)
    total_len = op.Cast(op.Squeeze(total), to=onnx.TensorProto.INT32)
    seen = op.ConstantOfShape(op.Concat(s, past, axis=0),
                              value=onnx.helper.make_tensor("zero", onnx.TensorProto.FLOAT, [1], [0.0]))
    new = op.Where(mask, op.Constant(value_float=0.0), op.Constant(value_float=-math.inf))
    bias = op.Unsqueeze(op.Concat(seen, new, axis=1), op.Constant(value_ints=[0, 1]))
    return _ms.GroupQueryAttention(query, key, value, key_cache, value_cache, seqlens_k,
                                   total_len, None, None, None, bias,
                                   num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale)


def _tree_attention(query, key, value, key_cache, value_cache, past_len, mask,
                    scale: float, num_heads: int, kv_num_heads: int):
    return _dflash.TreeAttention(query, key, value, key_cache, value_cache, past_len, mask,
                                 num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale)


def translation_table(impl: str) -> dict:
    """The `custom_translation_table` for torch.onnx.export."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {impl!r}; choose one of {IMPLEMENTATIONS}")
    fn = {"gqa": _gqa, "custom": _tree_attention}[impl]
    return {torch.ops.dflash.cached_attention.default: fn}
