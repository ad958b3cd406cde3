"""Greedy speculative decoding with prompt lookup gives exactly the plain greedy tokens."""

import pytest

from dflash.runtime import Model
from dflash.runtime.speculative import lookup_draft


def test_lookup_draft_follows_the_latest_match():
    assert lookup_draft([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3) == [7, 5, 1]
    assert lookup_draft([4, 5, 6], 2) == []
    assert lookup_draft([8, 1, 2, 8], 5) == [1, 2, 8]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lookup_is_lossless_on_tiny_models(tiny, arch):
    model = Model(tiny(arch)[0])
    for n, k in ((12, 4), (40, 8), (70, 16)):
        ids = [5 + i % 9 for i in range(n)]  # repetitive: lookup finds drafts
        plain = model.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True)
        spec = model.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True, drafter="lookup", draft_len=k)
        assert spec.tokens == plain.tokens
        assert spec.stats.steps <= plain.stats.steps


def test_lookup_stops_at_capacity_without_writing_past_it(tiny):
    model = Model(tiny("llama")[0])
    ids = [5 + i % 4 for i in range(100)]
    plain = model.generate(input_ids=ids, max_new_tokens=29, ignore_eos=True)
    spec = model.generate(input_ids=ids, max_new_tokens=29, ignore_eos=True, drafter="lookup", draft_len=16)
    assert spec.tokens == plain.tokens and len(spec.tokens) == 29


def test_sampling_with_a_drafter_is_refused_for_now(tiny):
    model = Model(tiny("llama")[0])
    with pytest.raises(ValueError, match="greedy only"):
        model.generate("the", temperature=0.7, drafter="lookup")
