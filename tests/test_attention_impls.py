"""The three attention implementations behind one graph contract: same tokens, tree masks work."""

import json

import numpy as np
import pytest

from conftest import BENCHMARK_PROMPTS
from dflash.runtime import Model

IMPLS = ["custom", "gqa", "onnx"]


@pytest.mark.parametrize("attention", IMPLS)
def test_tree_rows_see_exactly_their_ancestors(tiny, attention):
    """Logits of every tree node equal the logits of its root-to-node path decoded causally."""
    bundle, _ = tiny("qwen3", attention=attention)
    model = Model(bundle)
    target = model.target
    prompt = [7, 8, 9, 10, 11, 12]
    parents = [-1, 0, 0, 1, 2, 2]  # a tree in parent-before-child order
    tokens = [20, 21, 22, 23, 24, 25]
    depth = [0, 1, 1, 2, 2, 2]
    mask = np.eye(6, dtype=bool)
    for i, p in enumerate(parents):
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    target.prefill(prompt)
    past = len(prompt)
    tree_logits = target.forward(tokens, past + np.array(depth), mask, past).copy()
    for node in range(6):
        path, p = [], node
        while p >= 0:
            path.insert(0, tokens[p])
            p = parents[p]
        target.prefill(prompt)
        chain_logits = target.forward(path, np.arange(past, past + len(path)),
                                      np.tri(len(path), dtype=bool), past)
        np.testing.assert_allclose(tree_logits[node], chain_logits[-1], atol=1e-4)


def test_three_implementations_give_the_same_tokens_on_tiny_models(tiny):
    outputs = {}
    for attention in IMPLS:
        model = Model(tiny("llama", attention=attention)[0])
        assert model.bundle.attention == attention
        outputs[attention] = [model.generate(input_ids=list(range(3, 3 + n)), max_new_tokens=24,
                                             ignore_eos=True).tokens for n in (1, 40, 90)]
    assert outputs["custom"] == outputs["gqa"] == outputs["onnx"]


@pytest.mark.e2e
def test_default_model_custom_gqa_onnx_identical_on_benchmark_prompts(default_bundle, tmp_path_factory):
    from dflash.export.cli import export_target

    rows = [json.loads(line) for line in BENCHMARK_PROMPTS.read_text().splitlines()][::2]  # every kind
    outputs = {}
    for attention in IMPLS:
        bundle = default_bundle
        if Model(default_bundle).bundle.attention != attention:
            bundle = tmp_path_factory.mktemp(attention) / "bundle"
            export_target("default", bundle, attention=attention, max_len=512)
        model = Model(bundle)
        outputs[attention] = {row["id"]: model.generate(messages=row["messages"], max_new_tokens=32).tokens
                              for row in rows}
    assert outputs["custom"] == outputs["gqa"] == outputs["onnx"]
