"""TreeAttention and PackedTreeAttention over float16 and int8 (q8) KV caches: new rows stored
as ops/reference.py kv_store says, attention over the stored rows as the float32 op over their
widened values, and the lossless property (a row's bits do not depend on the rows verified with
it, nor on the kernel path) at every format."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import dflash.ops
from dflash.ops.reference import (causal_mask, kv_load, kv_row_width, kv_store, packed_tree_attention,
                                  tree_attention, tree_mask)
from test_ops import ORT_ERRORS, lib, random_tree, session  # noqa: F401  (fixture and helpers)

F = TensorProto.FLOAT
CACHE_TYPES = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "int8": TensorProto.UINT8}
FORMATS = ["fp16", "int8"]


def op_model(H, Hkv, D, kv_dtype, value_dtype=None):
    width = kv_row_width(kv_dtype, D)
    kt, vt = CACHE_TYPES[kv_dtype], CACHE_TYPES[value_dtype or kv_dtype]
    inputs = [helper.make_tensor_value_info("query", F, [1, "S", H * D]),
              helper.make_tensor_value_info("key", F, [1, "Skv", Hkv * D]),
              helper.make_tensor_value_info("value", F, [1, "Skv", Hkv * D]),
              helper.make_tensor_value_info("key_cache", kt, [1, Hkv, "C", width]),
              helper.make_tensor_value_info("value_cache", vt, [1, Hkv, "C", width]),
              helper.make_tensor_value_info("past_len", TensorProto.INT64, []),
              helper.make_tensor_value_info("mask", TensorProto.BOOL, ["S", "Skv"])]
    outputs = [helper.make_tensor_value_info("output", F, None),
               helper.make_tensor_value_info("present_key", kt, None),
               helper.make_tensor_value_info("present_value", vt, None)]
    node = helper.make_node("TreeAttention", [i.name for i in inputs], [o.name for o in outputs],
                            domain=dflash.ops.DOMAIN, num_heads=H, kv_num_heads=Hkv)
    return helper.make_model(helper.make_graph([node], "tree_attention", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(dflash.ops.DOMAIN, 1)])


def case(rng, S, past, C, H, Hkv, D, mask, kv_dtype):
    return dict(query=rng.standard_normal((1, S, H * D), dtype=np.float32),
                key=rng.standard_normal((1, S, Hkv * D), dtype=np.float32),
                value=rng.standard_normal((1, S, Hkv * D), dtype=np.float32),
                key_cache=kv_store(rng.standard_normal((1, Hkv, C, D), dtype=np.float32), kv_dtype),
                value_cache=kv_store(rng.standard_normal((1, Hkv, C, D), dtype=np.float32), kv_dtype),
                past_len=np.array(past, dtype=np.int64), mask=mask)


def stored_rows(x, Hkv, D, kv_dtype):
    """New rows [1, S, Hkv*D] as the cache stores them, [Hkv, S, width]."""
    S = x.shape[1]
    return kv_store(x.reshape(S, Hkv, D).transpose(1, 0, 2), kv_dtype)


@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("layout", [(9, 3, 64), (32, 8, 128), (8, 4, 80)], ids=lambda l: "x".join(map(str, l)))
@pytest.mark.parametrize("kind", ["causal", "tree"])
def test_stored_rows_and_attention_over_them(lib, kv_dtype, layout, kind):
    H, Hkv, D = layout
    rng = np.random.default_rng([H, D, len(kind), len(kv_dtype)])
    sess = session(op_model(H, Hkv, D, kv_dtype), threads=2)
    for S, past, C in [(1, 300, 320), (7, 0, 16), (16, 129, 200)]:
        mask = causal_mask(S) if kind == "causal" else tree_mask(random_tree(rng, S))
        feeds = case(rng, S, past, C, H, Hkv, D, mask, kv_dtype)
        out, pk, pv = sess.run(None, feeds)
        # the new rows, stored in the format, and the cache around them untouched
        for got, cache, new in ((pk, feeds["key_cache"], feeds["key"]), (pv, feeds["value_cache"], feeds["value"])):
            np.testing.assert_array_equal(got[0, :, past:past + S], stored_rows(new, Hkv, D, kv_dtype))
            np.testing.assert_array_equal(got[0, :, :past], cache[0, :, :past])
        # attention as the float32 op would compute it over the widened rows, new rows as stored
        wk, wv = kv_load(pk, kv_dtype, D), kv_load(pv, kv_dtype, D)
        q = feeds["query"]
        k_as_stored = wk[0, :, past:past + S].transpose(1, 0, 2).reshape(1, S, Hkv * D)
        v_as_stored = wv[0, :, past:past + S].transpose(1, 0, 2).reshape(1, S, Hkv * D)
        ref, _, _ = tree_attention(q, k_as_stored, v_as_stored, wk, wv, past, mask, 1 / np.sqrt(D), H, Hkv)
        assert np.abs(out - ref).max() <= 2e-5, (S, past)


@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("past", [0, 63, 200, 255, 700])
def test_rows_are_bit_identical_whatever_the_batch_and_path(lib, monkeypatch, kv_dtype, past):
    """The lossless property at every format: a tree node's row equals its token decoded alone
    (its ancestors then cached, as stored), for 1 and 2 threads and every kernel path. The paths
    store the same bytes and agree closely (their float32 arithmetic differs, as at fp32)."""
    H, Hkv, D, S, C = 9, 3, 64, 20, 1024
    rng = np.random.default_rng([past, len(kv_dtype)])
    mask = tree_mask(random_tree(rng, S))
    feeds = case(rng, S, past, C, H, Hkv, D, mask, kv_dtype)
    results = {}
    for path in ("avx512", "avx2", "portable"):
        monkeypatch.setenv("DFLASH_OPS_KERNELS", path)
        for threads in (1, 2):
            sess = session(op_model(H, Hkv, D, kv_dtype), threads)
            tree, pk, pv = sess.run(None, {k: v.copy() for k, v in feeds.items()})
            tree = tree[0]
            results[path, threads] = tree, pk, pv
            for i in range(S):
                seen = np.flatnonzero(mask[i])
                alone = {k: v.copy() for k, v in feeds.items()}
                alone.update(query=feeds["query"][:, [i]], key=feeds["key"][:, seen],
                             value=feeds["value"][:, seen], mask=np.ones((1, len(seen)), bool))
                assert np.array_equal(tree[i], sess.run(["output"], alone)[0][0][0]), (path, threads, i)
    first = next(iter(results.values()))
    for key, (tree, pk, pv) in results.items():
        assert np.abs(tree - first[0]).max() <= 1e-5, key
        assert np.array_equal(pk, first[1]) and np.array_equal(pv, first[2]), key


def packed_model(H, Hkv, D, kv_dtype):
    width, ct = kv_row_width(kv_dtype, D), CACHE_TYPES[kv_dtype]
    inputs = [helper.make_tensor_value_info("qkv", F, [1, "S", (H + 2 * Hkv) * D]),
              helper.make_tensor_value_info("key_cache", ct, [1, Hkv, "C", width]),
              helper.make_tensor_value_info("value_cache", ct, [1, Hkv, "C", width]),
              helper.make_tensor_value_info("past_len", TensorProto.INT64, []),
              helper.make_tensor_value_info("mask", TensorProto.BOOL, ["S", "S"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "S"]),
              helper.make_tensor_value_info("cos", F, ["P", D // 2]),
              helper.make_tensor_value_info("sin", F, ["P", D // 2])]
    outputs = [helper.make_tensor_value_info("output", F, None),
               helper.make_tensor_value_info("present_key", ct, None),
               helper.make_tensor_value_info("present_value", ct, None)]
    node = helper.make_node("PackedTreeAttention", [i.name for i in inputs], [o.name for o in outputs],
                            domain=dflash.ops.DOMAIN, num_heads=H, kv_num_heads=Hkv, scale=float(1 / np.sqrt(D)))
    return helper.make_model(helper.make_graph([node], "packed", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(dflash.ops.DOMAIN, 1)])


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_packed_op_stores_rotated_keys_in_the_format(lib, kv_dtype):
    H, Hkv, D, S, past, C = 8, 2, 64, 6, 40, 64
    rng = np.random.default_rng(len(kv_dtype))
    angles = np.arange(256)[:, None] * (10000.0 ** (-np.arange(D // 2) / (D // 2)))[None, :]
    feeds = dict(qkv=rng.standard_normal((1, S, (H + 2 * Hkv) * D), dtype=np.float32),
                 key_cache=kv_store(rng.standard_normal((1, Hkv, C, D), dtype=np.float32), kv_dtype),
                 value_cache=kv_store(rng.standard_normal((1, Hkv, C, D), dtype=np.float32), kv_dtype),
                 past_len=np.array(past, np.int64), mask=causal_mask(S),
                 position_ids=np.arange(past, past + S)[None].astype(np.int64),
                 cos=np.cos(angles).astype(np.float32), sin=np.sin(angles).astype(np.float32))
    out, pk, pv = session(packed_model(H, Hkv, D, kv_dtype), 2).run(None, feeds)
    f = feeds
    _, ref_k, ref_v = packed_tree_attention(f["qkv"], kv_load(f["key_cache"], kv_dtype, D),
                                            kv_load(f["value_cache"], kv_dtype, D), past, f["mask"],
                                            f["position_ids"], f["cos"], f["sin"], 1 / np.sqrt(D), H, Hkv)
    new = slice(past, past + S)
    np.testing.assert_array_equal(pk[0, :, new], kv_store(ref_k[0, :, new], kv_dtype))
    np.testing.assert_array_equal(pv[0, :, new], kv_store(ref_v[0, :, new], kv_dtype))
    wk, wv = kv_load(pk, kv_dtype, D), kv_load(pv, kv_dtype, D)
    q = f["qkv"].reshape(1, S, H + 2 * Hkv, D)[:, :, :H]
    from dflash.ops.reference import rotate_half
    qr = rotate_half(q, f["cos"][f["position_ids"][0]][None, :, None], f["sin"][f["position_ids"][0]][None, :, None])
    ref, _, _ = tree_attention(qr.reshape(1, S, H * D), wk[0, :, new].transpose(1, 0, 2).reshape(1, S, -1),
                               wv[0, :, new].transpose(1, 0, 2).reshape(1, S, -1), wk, wv, past, f["mask"],
                               1 / np.sqrt(D), H, Hkv)
    assert np.abs(out - ref).max() <= 2e-5


def test_mixed_or_unsupported_cache_types_are_refused_clearly(lib):
    H, Hkv, D = 4, 2, 32
    rng = np.random.default_rng(3)
    feeds = case(rng, 2, 3, 8, H, Hkv, D, causal_mask(2), "fp16")
    feeds["value_cache"] = rng.standard_normal((1, Hkv, 8, D), dtype=np.float32)
    with pytest.raises(ORT_ERRORS, match=r"Type \(tensor\(float16\)\) of output arg \(present_key\)"):
        session(op_model(H, Hkv, D, "fp16", value_dtype="fp32")).run(None, feeds)  # refused at load
    feeds = case(rng, 2, 3, 8, H, Hkv, D, causal_mask(2), "int8")
    feeds["key_cache"] = feeds["key_cache"][..., :D].copy()
    feeds["value_cache"] = feeds["value_cache"][..., :D].copy()
    model = op_model(H, Hkv, D, "int8")
    for value in model.graph.input[3:5]:  # leave the width free so the op sees it
        value.type.tensor_type.shape.dim[3].dim_param = "W"
    with pytest.raises(ORT_ERRORS, match=rf"key_cache must have shape \[1, 2, capacity, {kv_row_width('int8', D)}\]"):
        session(model).run(None, feeds)
