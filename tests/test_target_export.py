"""Tiny Llama / Qwen2 / Qwen3 models: exported graphs decode exactly like transformers."""

import numpy as np
import onnx
import pytest
import torch

from dflash.runtime import Model

ARCHS = ["llama", "qwen2", "qwen3"]


def hf_greedy(hf_folder, ids, n):
    """transformers' own forward with its KV cache, argmax each step, EOS not special."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_folder).eval()
    out, cache, step = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            result = model(step, past_key_values=cache, use_cache=True)
            cache = result.past_key_values
            out.append(int(result.logits[0, -1].argmax()))
            step = torch.tensor([[out[-1]]])
    return out


def prompt_ids(model, n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(3, model.bundle.vocab_size, n).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny, arch):
    bundle, hf = tiny(arch)
    model = Model(bundle)
    # length 1; a past that crosses the 128-row buffer's first half; a chunked (>64) prefill
    for length in (1, 50, 70):
        ids = prompt_ids(model, length, seed=length)
        result = model.generate(input_ids=ids, max_new_tokens=32, ignore_eos=True)
        expected = hf_greedy(hf, ids, 32)
        assert result.tokens == expected, f"{arch}, prompt of {length} tokens"
        assert len(set(expected)) > 3, "degenerate reference: the test would prove little"


def test_cache_buffers_are_updated_in_place(tiny):
    bundle, _ = tiny("llama")
    model = Model(bundle)
    caches = model.target.key_cache + model.target.value_cache
    addresses = [c.ctypes.data for c in caches]
    ids = prompt_ids(model, 5)
    model.generate(input_ids=ids, max_new_tokens=10, ignore_eos=True)
    assert [c.ctypes.data for c in caches] == addresses
    # prompt rows plus the 9 fed-back tokens were written into the bound buffers themselves
    written = 5 + 9
    for cache in caches:
        assert np.abs(cache[0, :, :written]).sum(axis=-1).min() > 0
    first = [c[0, :, :written].copy() for c in caches]
    model.generate(input_ids=ids, max_new_tokens=10, ignore_eos=True)
    for before, cache in zip(first, caches):
        np.testing.assert_array_equal(before, cache[0, :, :written])  # same prompt, same rows


def test_export_check_and_manifest(tiny):
    bundle, _ = tiny("qwen3")
    info = Model(bundle).bundle
    assert info.export_check["logits"] < 1e-4
    assert info.kv == {"layers": 4, "kv_heads": 2, "heads": 4, "head_dim": 16, "dtype": "fp32"}
    assert info.taps == [1] and info.attention == "custom"  # DFlash's rule, clamped for 4 layers
    assert (bundle / "tokenizer.json").is_file() and (bundle / "chat_template.jinja").is_file()


@pytest.mark.parametrize("dtype,requested,matmul", [("int8", None, "q8"), ("int4", None, "q4"),
                                                    ("int4", "nbits", "nbits"), ("int8", "nbits", "nbits")])
def test_quantized_export_runs(tiny, dtype, requested, matmul):
    """With the op library: our MatMulQ4 (int4, with an int8 lm_head) or MatMulQ8 (int8), row-count
    independent, no padding row; unless --matmul nbits: ORT's MatMulNBits, whose one-row calls get
    a padding row."""
    bundle, _ = tiny("llama", dtype=dtype, **({"matmul": requested} if requested else {}))
    model = Model(bundle)
    graph = model.bundle.graphs["target"]
    assert {k: v for k, v in graph.items() if k != "weights"} == {"file": f"target_{dtype}.onnx", "dtype": dtype,
                                                                   "matmul": matmul}
    ops = {node.op_type for node in onnx.load(str(bundle / f"target_{dtype}.onnx"), load_external_data=False).graph.node}
    own = {"q4": {"MatMulQ4", "MatMulQ8"}, "q8": {"MatMulQ8"}}
    assert ops & {"MatMulQ4", "MatMulQ8", "MatMulNBits", "MatMul"} == own.get(matmul, {"MatMulNBits"})
    if matmul == "q4":  # 4 layers x 4 projections searched, the lm_head int8
        assert graph["weights"] == {"searched (MatMulQ4, asymmetric)": 16, "round-to-nearest (MatMulQ8)": 1}
    assert model.target.min_rows == (2 if matmul == "nbits" else 1)
    result = model.generate("the quick brown fox", max_new_tokens=8)
    assert result.stats.new_tokens >= 1


def test_matmul_choice_is_checked_before_loading():
    from dflash.export.quantize import kernel_for
    from dflash.export.sources import SourceError

    with pytest.raises(SourceError, match="--matmul q4 needs --dtype int4 and --attention custom"):
        kernel_for("int4", "gqa", "q4")
    with pytest.raises(SourceError, match="--matmul q8 needs --dtype int8 and --attention custom"):
        kernel_for("int4", "custom", "q8")
    with pytest.raises(SourceError, match="applies to quantized targets"):
        kernel_for("fp32", "custom", "nbits")
    assert kernel_for("int4", "gqa") == "nbits" and kernel_for("fp32", "custom") is None
    assert kernel_for("int8", "custom") == "q8" and kernel_for("int8", "gqa") == "nbits"


def test_taps_are_the_tapped_layers_outputs(tiny):
    from transformers import AutoModelForCausalLM

    bundle, hf = tiny("qwen2", taps="0,2")
    model = Model(bundle)
    ids = prompt_ids(model, 7)
    model.target.prefill(ids)
    taps = model.target.taps(7)
    with torch.no_grad():
        hidden = AutoModelForCausalLM.from_pretrained(hf)(torch.tensor([ids]), output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[i + 1][0] for i in model.bundle.taps], dim=-1).numpy()  # id i = output of layer i
    np.testing.assert_allclose(taps, expected, atol=1e-4)


@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_export_check_fails_on_a_corrupted_quantized_weight(tiny, tmp_path, dtype):
    """The quantized export's check compares against the source weights quantized by the weight
    plan, not read back from the graph, so a wrong quantized weight in the graph fails it (it
    passes on the graph as exported)."""
    import shutil

    import onnx
    from onnx import numpy_helper

    from dflash.export import sources
    from dflash.export.check import check_target
    from dflash.export.quantize import weight_plan

    bundle, hf = tiny("llama", dtype=dtype)
    info = Model(bundle).bundle
    assert info.export_check["passed"] and info.export_check["logits"] <= info.export_check["logits_bound"]
    broken = tmp_path / "broken"
    shutil.copytree(bundle, broken)
    graph = broken / info.graphs["target"]["file"]
    model = onnx.load(str(graph))
    packed = next(t for t in model.graph.initializer if t.data_type == onnx.TensorProto.UINT8)
    values = numpy_helper.to_array(packed).copy()
    values.reshape(-1)[: values.size // 4] ^= 0x88  # a quarter of one weight: every 4-bit group 8 steps off
    packed.CopyFrom(numpy_helper.from_array(values, packed.name))
    (broken / (graph.name + ".data")).unlink()
    onnx.save(model, str(graph), save_as_external_data=True, location=graph.name + ".data")
    plan = weight_plan(str(hf), dtype)
    model = sources.load(str(hf)).model
    result = check_target(model, info.taps, broken, plan=plan)
    assert not result["passed"] and result["logits"] > result["logits_bound"]
    assert check_target(model, info.taps, bundle, plan=plan)["passed"]
