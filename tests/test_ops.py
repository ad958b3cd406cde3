"""Tests of the TreeAttention custom op (dflash.ops) against its numpy reference and ORT's own ops."""

from __future__ import annotations

import zlib

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

import dflash.ops
from dflash.ops.reference import causal_mask, full_mask, tree_attention, tree_mask

ORT_ERRORS = (ort_state.Fail, ort_state.InvalidArgument, ort_state.RuntimeException, ort_state.InvalidGraph)


def _library_or_skip():
    try:
        return dflash.ops.library_path()
    except dflash.ops.OpsLibraryError as e:
        pytest.skip(f"op library not built ({e})")


@pytest.fixture(scope="module")
def lib():
    return _library_or_skip()


# ------------------------------------------------------------------------------------------------
# helpers

F = TensorProto.FLOAT


def op_model(H, Hkv, D, scale=None, shapes=True, mask_type=TensorProto.BOOL, past_type=TensorProto.INT64,
             past_shape=(), extra_attrs=None, batch=1):
    """One-node model of TreeAttention. shapes=False leaves the graph inputs without shapes, so
    that bad shapes reach the op instead of being refused by onnxruntime's own checks."""

    def vi(name, dtype, shape):
        return helper.make_tensor_value_info(name, dtype, list(shape) if shapes else None)

    inputs = [
        vi("query", F, [batch, "S", H * D]),
        vi("key", F, [batch, "Skv", Hkv * D]),
        vi("value", F, [batch, "Skv", Hkv * D]),
        vi("key_cache", F, [batch, Hkv, "C", D]),
        vi("value_cache", F, [batch, Hkv, "C", D]),
        vi("past_len", past_type, past_shape),
        vi("mask", mask_type, ["S", "Skv"]),
    ]
    outputs = [helper.make_tensor_value_info(n, F, None) for n in ("output", "present_key", "present_value")]
    attrs = dict(num_heads=H, kv_num_heads=Hkv)
    if scale is not None:
        attrs["scale"] = float(scale)
    attrs.update(extra_attrs or {})
    node = helper.make_node("TreeAttention", [i.name for i in inputs], [o.name for o in outputs],
                            domain=dflash.ops.DOMAIN, **attrs)
    graph = helper.make_graph([node], "tree_attention", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(dflash.ops.DOMAIN, 1)])


def session(model, threads=1):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 4  # the error tests fail on purpose; keep ORT's log quiet
    dflash.ops.register(so)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def random_case(rng, S, Skv, past, C, H, Hkv, D, mask):
    return dict(
        query=rng.standard_normal((1, S, H * D), dtype=np.float32),
        key=rng.standard_normal((1, Skv, Hkv * D), dtype=np.float32),
        value=rng.standard_normal((1, Skv, Hkv * D), dtype=np.float32),
        key_cache=rng.standard_normal((1, Hkv, C, D), dtype=np.float32),
        value_cache=rng.standard_normal((1, Hkv, C, D), dtype=np.float32),
        past_len=np.array(past, dtype=np.int64),
        mask=mask,
    )


def reference(feeds, scale, H, Hkv):
    f = feeds
    return tree_attention(f["query"], f["key"], f["value"], f["key_cache"], f["value_cache"], f["past_len"],
                          f["mask"], scale, H, Hkv)


def random_tree(rng, n):
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


def make_mask(kind, S, rng):
    if kind == "causal":
        return causal_mask(S)
    if kind == "tree":
        return tree_mask(random_tree(rng, S))
    return full_mask(S)


# ------------------------------------------------------------------------------------------------
# numerics against the reference

# (H, Hkv, D): the two target layouts, plain multi-head, multi-query (G = 16), and G = 2 with a
# head_dim that is not a multiple of 64.
LAYOUTS = [(9, 3, 64), (32, 8, 128), (4, 4, 32), (16, 1, 64), (8, 4, 80)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "x".join(map(str, l)))
@pytest.mark.parametrize("kind", ["causal", "tree", "full"])
def test_matches_reference(lib, layout, threads, kind):
    H, Hkv, D = layout
    rng = np.random.default_rng(zlib.crc32(repr((layout, threads, kind)).encode()))
    scale = 1.0 / np.sqrt(D)
    sess = session(op_model(H, Hkv, D, scale), threads)
    for _ in range(3):
        C = int(rng.integers(64, 300))
        S = int(rng.integers(1, 65))
        past = int(rng.integers(0, C - S + 1))
        feeds = random_case(rng, S, S, past, C, H, Hkv, D, make_mask(kind, S, rng))
        out, pk, pv = sess.run(None, feeds)
        ref_out, ref_pk, ref_pv = reference(feeds, scale, H, Hkv)
        assert np.abs(out - ref_out).max() <= 1e-5, (S, past, C)
        np.testing.assert_array_equal(pk, ref_pk)
        np.testing.assert_array_equal(pv, ref_pv)


@pytest.mark.parametrize("S,past,C", [(1, 0, 1), (1, 4000, 4100), (3, 2000, 2003), (64, 0, 64), (17, 129, 200)])
def test_edge_sizes(lib, S, past, C):
    """Full capacity, decode with a long cache (key range split into chunks), empty past."""
    H, Hkv, D = 8, 2, 48  # head_dim not a multiple of 16 exercises the masked vector tails
    rng = np.random.default_rng(S * 7 + past)
    sess = session(op_model(H, Hkv, D, 0.1), threads=2)
    feeds = random_case(rng, S, S, past, C, H, Hkv, D, causal_mask(S))
    out, pk, _ = sess.run(None, feeds)
    ref_out, ref_pk, _ = reference(feeds, 0.1, H, Hkv)
    assert np.abs(out - ref_out).max() <= 1e-5
    np.testing.assert_array_equal(pk, ref_pk)


@pytest.mark.parametrize("kernels", ["portable", "avx2"])
def test_other_kernel_paths_match(lib, monkeypatch, kernels):
    """The portable and AVX2 kernels (chosen at session creation) give the same results.
    (On a CPU without AVX2 the "avx2" request runs the portable path.)"""
    monkeypatch.setenv("DFLASH_OPS_KERNELS", kernels)
    rng = np.random.default_rng(5)
    for H, Hkv, D in [(9, 3, 64), (8, 2, 40)]:
        sess = session(op_model(H, Hkv, D, 0.125), threads=2)
        for S, past, C, kind in [(16, 200, 300, "tree"), (1, 1000, 1100, "causal"), (40, 0, 64, "full"), (5, 3, 9, "tree")]:
            feeds = random_case(rng, S, S, past, C, H, Hkv, D, make_mask(kind, S, rng))
            out, pk, _ = sess.run(None, feeds)
            ref_out, ref_pk, _ = reference(feeds, 0.125, H, Hkv)
            assert np.abs(out - ref_out).max() <= 1e-5
            np.testing.assert_array_equal(pk, ref_pk)


def test_default_scale_and_past_variants(lib):
    """No scale attribute means 1/sqrt(D); past_len may have shape [] or [1]."""
    H, Hkv, D = 4, 2, 32
    rng = np.random.default_rng(11)
    feeds = random_case(rng, 5, 5, 7, 20, H, Hkv, D, tree_mask([-1, 0, 0, 1, 2]))
    ref = reference(feeds, 1.0 / np.sqrt(D), H, Hkv)[0]
    assert np.abs(session(op_model(H, Hkv, D)).run(None, feeds)[0] - ref).max() <= 1e-5
    f1 = dict(feeds, past_len=np.array([7], dtype=np.int64))
    assert np.abs(session(op_model(H, Hkv, D, past_shape=[1])).run(None, f1)[0] - ref).max() <= 1e-5


def test_queries_and_new_keys_differ_in_count(lib):
    """S query rows over S_kv != S new rows (e.g. a block attending to context + itself)."""
    H, Hkv, D = 6, 2, 32
    rng = np.random.default_rng(2)
    mask = rng.random((4, 10)) < 0.5
    feeds = random_case(rng, 4, 10, 30, 50, H, Hkv, D, mask)
    out, pk, _ = session(op_model(H, Hkv, D, 0.2), 2).run(None, feeds)
    ref_out, ref_pk, _ = reference(feeds, 0.2, H, Hkv)
    assert np.abs(out - ref_out).max() <= 1e-5
    np.testing.assert_array_equal(pk, ref_pk)


@pytest.mark.parametrize("S,Skv,past,C", [(0, 3, 2, 8), (3, 0, 5, 8), (2, 0, 0, 0), (0, 0, 0, 0), (1, 1, 0, 1)])
def test_empty_shapes(lib, S, Skv, past, C):
    """No queries, no new rows, or an empty cache: still well defined (zeros where nothing is seen)."""
    H, Hkv, D = 4, 2, 16
    rng = np.random.default_rng(S + 10 * Skv)
    feeds = random_case(rng, S, Skv, past, C, H, Hkv, D, np.ones((S, Skv), dtype=bool))
    out, pk, pv = session(op_model(H, Hkv, D, 0.3), 2).run(None, feeds)
    ref_out, ref_pk, ref_pv = reference(feeds, 0.3, H, Hkv)
    assert out.shape == (1, S, H * D)
    assert np.abs(out - ref_out).max(initial=0.0) <= 1e-5
    np.testing.assert_array_equal(pk, ref_pk)
    np.testing.assert_array_equal(pv, ref_pv)


def test_rows_that_see_nothing(lib):
    """A mask row that is all false gives zeros when past is 0 and cache-only attention otherwise."""
    H, Hkv, D = 4, 1, 16
    rng = np.random.default_rng(3)
    mask = causal_mask(6)
    mask[2, :] = False
    mask[5, :] = False
    sess = session(op_model(H, Hkv, D, 0.25))
    for past in (0, 9):
        feeds = random_case(rng, 6, 6, past, 32, H, Hkv, D, mask)
        out = sess.run(None, feeds)[0]
        assert np.isfinite(out).all()
        assert np.abs(out - reference(feeds, 0.25, H, Hkv)[0]).max() <= 1e-5
        if past == 0:
            assert not out[0, 2].any() and not out[0, 5].any()


# ------------------------------------------------------------------------------------------------
# cache buffers: in place with IOBinding, copy otherwise


def _bind(sess, feeds, kc, vc):
    io = sess.io_binding()
    for name in ("query", "key", "value", "past_len", "mask"):
        io.bind_cpu_input(name, feeds[name])
    io.bind_ortvalue_input("key_cache", kc)
    io.bind_ortvalue_input("value_cache", vc)
    io.bind_output("output")
    io.bind_ortvalue_output("present_key", kc)
    io.bind_ortvalue_output("present_value", vc)
    return io


@pytest.mark.parametrize("threads", [1, 2])
def test_shared_buffer_is_updated_in_place(lib, threads):
    H, Hkv, D = 9, 3, 64
    S, past, C = 7, 40, 80
    rng = np.random.default_rng(7)
    feeds = random_case(rng, S, S, past, C, H, Hkv, D, tree_mask([-1, 0, 0, 1, 1, 2, 5]))
    # rows at and beyond past+S must never be read: poison them
    feeds["key_cache"][:, :, past + S:] = np.nan
    feeds["value_cache"][:, :, past + S:] = np.nan
    k_before, v_before = feeds["key_cache"].copy(), feeds["value_cache"].copy()
    ref_out, ref_pk, ref_pv = reference(feeds, 0.125, H, Hkv)

    kbuf, vbuf = feeds["key_cache"], feeds["value_cache"]
    kc = ort.OrtValue.ortvalue_from_numpy(kbuf)
    vc = ort.OrtValue.ortvalue_from_numpy(vbuf)
    assert kc.data_ptr() == kbuf.ctypes.data  # the OrtValue wraps the numpy memory
    sess = session(op_model(H, Hkv, D, 0.125), threads)
    io = _bind(sess, feeds, kc, vc)
    sess.run_with_iobinding(io)

    out = io.copy_outputs_to_cpu()[0]
    assert np.abs(out - ref_out).max() <= 1e-5
    assert kc.data_ptr() == kbuf.ctypes.data and vc.data_ptr() == vbuf.ctypes.data
    # new rows written into the numpy buffers themselves
    np.testing.assert_array_equal(kbuf[:, :, past:past + S], ref_pk[:, :, past:past + S])
    np.testing.assert_array_equal(vbuf[:, :, past:past + S], ref_pv[:, :, past:past + S])
    # everything else untouched (NaN rows compared bitwise)
    for buf, before in ((kbuf, k_before), (vbuf, v_before)):
        assert buf[:, :, :past].tobytes() == before[:, :, :past].tobytes()
        assert buf[:, :, past + S:].tobytes() == before[:, :, past + S:].tobytes()

    # a second step appends after the first, still in place
    feeds2 = random_case(rng, 2, 2, past + S, C, H, Hkv, D, causal_mask(2))
    snapshot = kbuf.copy()
    ref2 = tree_attention(feeds2["query"], feeds2["key"], feeds2["value"], snapshot, vbuf.copy(), past + S,
                          feeds2["mask"], 0.125, H, Hkv)
    io2 = _bind(sess, feeds2, kc, vc)
    sess.run_with_iobinding(io2)
    assert np.abs(io2.copy_outputs_to_cpu()[0] - ref2[0]).max() <= 1e-5
    np.testing.assert_array_equal(kbuf[:, :, past + S:past + S + 2], ref2[1][:, :, past + S:past + S + 2])


def test_copy_path_leaves_inputs_alone(lib):
    H, Hkv, D = 32, 8, 128
    S, past, C = 5, 20, 40
    rng = np.random.default_rng(8)
    feeds = random_case(rng, S, S, past, C, H, Hkv, D, causal_mask(S))
    k_before = feeds["key_cache"].copy()
    out, pk, pv = session(op_model(H, Hkv, D, 0.1), 2).run(None, feeds)
    ref_out, ref_pk, ref_pv = reference(feeds, 0.1, H, Hkv)
    np.testing.assert_array_equal(feeds["key_cache"], k_before)
    np.testing.assert_array_equal(pk, ref_pk)  # whole cache copied, new rows written
    np.testing.assert_array_equal(pv, ref_pv)
    assert np.abs(out - ref_out).max() <= 1e-5


# ------------------------------------------------------------------------------------------------
# errors: a clean onnxruntime exception naming the problem, and the process goes on


def _good(rng, S=4, past=3, C=16, H=4, Hkv=2, D=8):
    return random_case(rng, S, S, past, C, H, Hkv, D, causal_mask(S))


BAD_INPUTS = {
    "capacity": (lambda f: dict(f, past_len=np.array(13, np.int64)), "13 \\+ 4 new rows exceeds cache capacity 16"),
    "negative past": (lambda f: dict(f, past_len=np.array(-1, np.int64)), "past_len -1 is negative"),
    "query width": (lambda f: dict(f, query=np.zeros((1, 4, 30), np.float32)), "query width 30"),
    "query rank": (lambda f: dict(f, query=np.zeros((4, 32), np.float32)), "query must have shape"),
    "key width": (lambda f: dict(f, key=np.zeros((1, 4, 15), np.float32), value=np.zeros((1, 4, 15), np.float32)),
                  "key width 15 is not a positive multiple of kv_num_heads 2"),
    "value shape": (lambda f: dict(f, value=np.zeros((1, 3, 16), np.float32)), "value shape"),
    "key_cache shape": (lambda f: dict(f, key_cache=np.zeros((1, 3, 16, 8), np.float32)), "key_cache must have shape"),
    "value_cache shape": (lambda f: dict(f, value_cache=np.zeros((1, 2, 17, 8), np.float32)), "value_cache shape"),
    "mask shape": (lambda f: dict(f, mask=np.ones((4, 5), bool)), "mask must have shape \\[S, S_kv\\]"),
    "mask rank": (lambda f: dict(f, mask=np.ones((1, 1, 4, 4), bool)), "mask must have shape"),
    "past shape": (lambda f: dict(f, past_len=np.array([1, 2], np.int64)), "past_len must be a scalar"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_inputs_raise_clean_errors(lib, case):
    rng = np.random.default_rng(0)
    sess = session(op_model(4, 2, 8, 0.3, shapes=False), threads=2)
    change, message = BAD_INPUTS[case]
    with pytest.raises(ORT_ERRORS, match=f"TreeAttention: .*{message}"):
        sess.run(None, change(_good(rng)))
    # the session (and process) still works
    good = _good(rng)
    assert np.abs(sess.run(None, good)[0] - reference(good, 0.3, 4, 2)[0]).max() <= 1e-5


def test_wrong_dtypes_raise_clean_errors(lib):
    """mask and past_len have one type each (the caches' several: see GetInputType), so
    onnxruntime refuses a graph that gives them another at load, naming the input."""
    for name, kind in (("mask", dict(mask_type=TensorProto.FLOAT)), ("past_len", dict(past_type=TensorProto.INT32))):
        with pytest.raises(ORT_ERRORS, match=rf"input parameter \({name}\) of operator \(TreeAttention\)"):
            session(op_model(4, 2, 8, 0.3, shapes=False, **kind))


def test_heads_not_a_multiple_fails_at_session_creation(lib):
    with pytest.raises(ORT_ERRORS, match="num_heads 6 must be a positive multiple of kv_num_heads 4"):
        session(op_model(6, 4, 8, 0.3, shapes=False))
    with pytest.raises(ORT_ERRORS, match="TreeAttention"):
        session(op_model(4, 2, 8, 0.3, shapes=False, extra_attrs=dict(kv_num_heads=0)))


# ------------------------------------------------------------------------------------------------
# the loader


def test_library_path_missing_env_file(monkeypatch, tmp_path):
    missing = tmp_path / "nope" / "libdflash_ops.so"
    monkeypatch.setenv("DFLASH_OPS_LIB", str(missing))
    with pytest.raises(dflash.ops.OpsLibraryError) as ei:
        dflash.ops.library_path()
    msg = str(ei.value)
    assert str(missing) in msg and "DFLASH_OPS_LIB" in msg and "make ops" in msg and "ops/build.sh" in msg
    assert isinstance(ei.value, RuntimeError)


def test_register_reports_unloadable_library(monkeypatch, tmp_path):
    bogus = tmp_path / "libdflash_ops.so"
    bogus.write_bytes(b"not a shared library")
    monkeypatch.setenv("DFLASH_OPS_LIB", str(bogus))
    with pytest.raises(dflash.ops.OpsLibraryError) as ei:
        dflash.ops.register(ort.SessionOptions())
    msg = str(ei.value)
    assert str(bogus) in msg and ort.__version__ in msg and "rebuild" in msg


def test_constants():
    assert dflash.ops.DOMAIN == "ai.dflash" and dflash.ops.OP == "TreeAttention"


# ------------------------------------------------------------------------------------------------
# the ORT baselines agree with the op (pins down the GQA input conventions the exporter relies on)


@pytest.mark.parametrize("layout", [(9, 3, 64), (32, 8, 128)], ids=lambda l: "x".join(map(str, l)))
@pytest.mark.parametrize("kind", ["causal", "tree"])
def test_gqa_and_onnx_attention_agree(lib, layout, kind):
    from dflash.bench.attention import attention_output, make_inputs

    H, Hkv, D = layout
    S, past = 12, 50
    rng = np.random.default_rng(4)
    mask = causal_mask(S) if kind == "causal" else tree_mask(random_tree(rng, S))
    x = make_inputs(S, past, past + S + 20, H, Hkv, D, mask=mask, seed=9)
    ref = tree_attention(x["query"], x["key"], x["value"], x["key_cache"], x["value_cache"], past, x["mask"],
                         1.0 / np.sqrt(D), H, Hkv)[0]
    outs = {impl: attention_output(impl, x, past, threads=2) for impl in ("custom", "gqa", "onnx")}
    for impl, out in outs.items():
        assert np.abs(out - ref).max() <= 1e-4, impl
    assert np.abs(outs["custom"] - outs["gqa"]).max() <= 1e-4
    assert np.abs(outs["custom"] - outs["onnx"]).max() <= 1e-4


def test_bench_attention_runs(lib):
    from dflash.bench.attention import bench_attention

    for impl in ("custom", "gqa", "onnx"):
        t = bench_attention(impl, S=4, past=32, threads=1, heads=4, kv_heads=2, head_dim=16, capacity=64, repeats=3)
        assert t > 0


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.parametrize("past", [200, 240, 300, 700, 1500])
def test_a_row_is_bit_identical_whatever_the_batch(lib, H, Hkv, D, past):
    """Losslessness rests on this: a query row's output must not depend on how many rows are
    verified with it (1 in plain decoding, up to a tree's worth in a verify), nor on the threads."""
    rng = np.random.default_rng(past)
    C = 2048
    base = random_case(rng, 25, 25, past, C, H, Hkv, D, causal_mask(25))
    outputs = {}
    for threads in (1, 2):
        sess = session(op_model(H, Hkv, D), threads)
        for S in (1, 2, 5, 8, 16, 25):
            feeds = {k: v.copy() for k, v in base.items()}
            feeds.update(query=base["query"][:, :S], key=base["key"][:, :S], value=base["value"][:, :S],
                         mask=causal_mask(S))
            outputs[threads, S] = sess.run(["output"], feeds)[0][0]
    reference = outputs[1, 25]
    for (threads, S), out in outputs.items():
        assert np.array_equal(out, reference[:S]), (threads, S)


def decoded_alone(sess, feeds, i):
    """Row i's output when its token is decoded alone: the new rows it sees follow the cache in
    order and it is the only query (what plain decoding gives it, its ancestors cached)."""
    seen = np.flatnonzero(feeds["mask"][i])
    alone = {k: v.copy() for k, v in feeds.items()}
    alone.update(query=feeds["query"][:, [i]], key=feeds["key"][:, seen], value=feeds["value"][:, seen],
                 mask=np.ones((1, len(seen)), bool))
    return sess.run(["output"], alone)[0][0][0]


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 4, 32), (16, 1, 80)])
@pytest.mark.parametrize("past", [0, 5, 63, 64, 120, 125, 200, 250, 255, 256, 300, 700, 1500])
def test_every_tree_row_is_bit_identical_to_its_token_decoded_alone(lib, H, Hkv, D, past):
    """Losslessness of tree verification: every node, including those off the first chain (whose
    ancestors sit at verify rows with gaps between them), gives the bits its token gets in plain
    decoding. Pasts around the softmax block (64) and chunk (256) edges, 1 and 2 threads."""
    S, C = 24, 2048
    rng = np.random.default_rng([past, H, D])
    mask = tree_mask(random_tree(rng, S))
    feeds = random_case(rng, S, S, past, C, H, Hkv, D, mask)
    for threads in (1, 2):
        sess = session(op_model(H, Hkv, D), threads)
        tree = sess.run(["output"], {k: v.copy() for k, v in feeds.items()})[0][0]
        for i in range(S):
            assert np.array_equal(tree[i], decoded_alone(sess, feeds, i)), (threads, i, np.flatnonzero(mask[i]))


# ------------------------------------------------------------------------------------------------
# PackedTreeAttention (rotary in the op)

def packed_model(H, Hkv, D, scale, batch=1, past_shape=()):
    inputs = [helper.make_tensor_value_info("qkv", F, [batch, "S", (H + 2 * Hkv) * D]),
              helper.make_tensor_value_info("key_cache", F, [batch, Hkv, "C", D]),
              helper.make_tensor_value_info("value_cache", F, [batch, Hkv, "C", D]),
              helper.make_tensor_value_info("past_len", TensorProto.INT64, list(past_shape)),
              helper.make_tensor_value_info("mask", TensorProto.BOOL, ["S", "S"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, [batch, "S"]),
              helper.make_tensor_value_info("cos", F, ["P", D // 2]),
              helper.make_tensor_value_info("sin", F, ["P", D // 2])]
    outputs = [helper.make_tensor_value_info(n, F, None) for n in ("output", "present_key", "present_value")]
    node = helper.make_node("PackedTreeAttention", [i.name for i in inputs], [o.name for o in outputs],
                            domain=dflash.ops.DOMAIN, num_heads=H, kv_num_heads=Hkv, scale=float(scale))
    return helper.make_model(helper.make_graph([node], "packed", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(dflash.ops.DOMAIN, 1)])


def packed_case(rng, S, past, C, H, Hkv, D, mask, positions=None):
    angles = np.arange(4096)[:, None] * (10000.0 ** (-np.arange(D // 2) / (D // 2)))[None, :]
    return dict(qkv=rng.standard_normal((1, S, (H + 2 * Hkv) * D), dtype=np.float32),
                key_cache=rng.standard_normal((1, Hkv, C, D), dtype=np.float32),
                value_cache=rng.standard_normal((1, Hkv, C, D), dtype=np.float32),
                past_len=np.array(past, dtype=np.int64), mask=mask,
                position_ids=(np.arange(past, past + S) if positions is None else positions)[None].astype(np.int64),
                cos=np.cos(angles).astype(np.float32), sin=np.sin(angles).astype(np.float32))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", [(9, 3, 64), (32, 8, 128), (4, 4, 32)], ids=lambda l: "x".join(map(str, l)))
@pytest.mark.parametrize("kind", ["causal", "tree"])
def test_packed_matches_reference(lib, layout, threads, kind):
    from dflash.ops.reference import packed_tree_attention

    H, Hkv, D = layout
    rng = np.random.default_rng(zlib.crc32(repr(("packed", layout, threads, kind)).encode()))
    sess = session(packed_model(H, Hkv, D, 0.125), threads)
    for S, past in ((1, 0), (7, 40), (25, 700)):
        mask = make_mask(kind, S, rng)
        positions = None if kind == "causal" else past + mask.sum(1) - 1  # tree: position = past + depth
        feeds = packed_case(rng, S, past, 1024, H, Hkv, D, mask, positions)
        out, pk, pv = sess.run(None, feeds)
        ref = packed_tree_attention(feeds["qkv"], feeds["key_cache"], feeds["value_cache"], feeds["past_len"],
                                    mask, feeds["position_ids"], feeds["cos"], feeds["sin"], 0.125, H, Hkv)
        assert np.abs(out - ref[0]).max() <= 1e-5, (S, past)
        assert np.abs(pk - ref[1]).max() <= 1e-6 and np.array_equal(pv, ref[2])


def test_packed_refuses_bad_inputs_clearly(lib):
    sess = session(packed_model(9, 3, 64, 0.125))
    rng = np.random.default_rng(0)
    feeds = packed_case(rng, 4, 10, 64, 9, 3, 64, causal_mask(4))
    with pytest.raises(ORT_ERRORS, match="exceeds cache capacity"):
        sess.run(None, {**feeds, "past_len": np.array(62, np.int64)})
    with pytest.raises(ORT_ERRORS, match="outside the rotary tables"):
        sess.run(None, {**feeds, "position_ids": np.array([[0, 1, 2, 5000]], np.int64)})
    with pytest.raises(ORT_ERRORS, match="mask must be bool"):
        sess.run(None, {**feeds, "mask": causal_mask(3)})



# ------------------------------------------------------------------------------------------------
# Batches: several sequences, each with its own cache and length (the batched data graph)

def _alone(feeds: dict, b: int, batched: tuple[str, ...]) -> dict:
    """Sequence b's inputs as a batch of one (its own past length)."""
    alone = {k: (v[b : b + 1].copy() if k in batched else v.copy()) for k, v in feeds.items()}
    alone["past_len"] = np.array(feeds["past_len"][b], np.int64)
    return alone


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("S", [1, 6])
def test_a_batch_computes_every_sequence_as_it_would_alone(lib, threads, S):
    """Each sequence of a batch attends only its own cache and gets the bits it gets alone (the
    batched data job relies on it to sample what one sequence at a time samples), pasts on either
    side of the softmax block (64) and chunk (256) edges."""
    H, Hkv, D, C = 9, 3, 64, 1024
    pasts = np.array([0, 63, 300, 5], np.int64)
    B = len(pasts)
    rng = np.random.default_rng([threads, S])
    mask = tree_mask(random_tree(rng, S))
    feeds = random_case(rng, S, S, 0, C, H, Hkv, D, mask)
    feeds.update({k: rng.standard_normal((B, *feeds[k].shape[1:]), dtype=np.float32)
                  for k in ("query", "key", "value", "key_cache", "value_cache")}, past_len=pasts)
    batched = ("query", "key", "value", "key_cache", "value_cache")
    together = session(op_model(H, Hkv, D, batch="B", past_shape=["B"]), threads)
    single = session(op_model(H, Hkv, D), threads)
    out, pk, pv = together.run(None, {k: v.copy() for k, v in feeds.items()})
    for b in range(B):
        want = single.run(None, _alone(feeds, b, batched))
        assert np.array_equal(out[b], want[0][0]) and np.array_equal(pk[b], want[1][0]), b
        assert np.array_equal(pv[b], want[2][0]), b

    packed = session(packed_model(H, Hkv, D, 0.125, batch="B", past_shape=["B"]), threads)
    packed_single = session(packed_model(H, Hkv, D, 0.125), threads)
    cases = [packed_case(rng, S, int(p), C, H, Hkv, D, mask) for p in pasts]
    pfeeds = {k: np.concatenate([c[k] for c in cases]) for k in ("qkv", "key_cache", "value_cache", "position_ids")}
    pfeeds.update(past_len=pasts, mask=mask, cos=cases[0]["cos"], sin=cases[0]["sin"])
    out, pk, pv = packed.run(None, pfeeds)
    for b in range(B):
        want = packed_single.run(None, _alone(pfeeds, b, ("qkv", "key_cache", "value_cache", "position_ids")))
        assert np.array_equal(out[b], want[0][0]) and np.array_equal(pk[b], want[1][0]), b


def test_a_batch_with_one_past_length_for_all_and_bad_lengths(lib):
    """A scalar past_len applies to every sequence; a past_len of another count is a clear error."""
    H, Hkv, D = 4, 2, 8
    rng = np.random.default_rng(7)
    feeds = random_case(rng, 3, 3, 5, 32, H, Hkv, D, causal_mask(3))
    feeds.update({k: rng.standard_normal((2, *feeds[k].shape[1:]), dtype=np.float32)
                  for k in ("query", "key", "value", "key_cache", "value_cache")})
    sess = session(op_model(H, Hkv, D, shapes=False))
    shared = sess.run(None, {k: v.copy() for k, v in feeds.items()})[0]
    each = sess.run(None, {**{k: v.copy() for k, v in feeds.items()}, "past_len": np.array([5, 5], np.int64)})[0]
    assert np.array_equal(shared, each)
    with pytest.raises(ORT_ERRORS, match=r"one length per sequence \(shape \[2\]\)"):
        sess.run(None, {**feeds, "past_len": np.array([5, 5, 5], np.int64)})
    with pytest.raises(ORT_ERRORS, match=r"key_cache must have shape \[2, 2, capacity, 8\]"):
        sess.run(None, {**feeds, "key_cache": feeds["key_cache"][:1], "value_cache": feeds["value_cache"][:1]})
    with pytest.raises(ORT_ERRORS, match="exceeds cache capacity"):
        sess.run(None, {**feeds, "past_len": np.array([5, 30], np.int64)})
