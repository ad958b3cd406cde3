"""Speculative decoding is lossless: the same tokens as plain decoding for every drafter
(greedy, and seed for seed when sampling), the same distribution when sampling, trees
compacted correctly, capacity respected, mismatched tokenizers refused."""

import collections
import math
import shutil

import numpy as np
import pytest

from dflash.runtime import BundleError, Model
from dflash.runtime.drafters import Drafter, HybridDrafter, LookupDrafter, NgramLookup, lookup_draft
from dflash.runtime.policy import MAX_DRAFT, Acceptance, Beside, Policy, VerifyCost
from dflash.runtime.speculative import Draft, accept
from dflash.runtime.target import causal_mask


def test_lookup_draft_follows_the_latest_match():
    assert lookup_draft([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3) == ([7, 5, 1], 3)
    assert lookup_draft([4, 5, 6], 2) == ([], 0)
    assert lookup_draft([8, 1, 2, 8], 5) == ([1, 2, 8], 1)


def test_the_growing_ngram_index_drafts_what_the_scan_does():
    """A text grown a few tokens at a time (as a generation's history is), then another text."""
    import random

    rng = random.Random(0)
    index = NgramLookup()
    for _ in range(3):
        text = [rng.randrange(6)]
        while len(text) < 300:
            text = text + [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
            assert index(text, 7) == lookup_draft(text, 7), len(text)
    assert index([4, 5, 6], 2) == ([], 0) and index([8, 1, 2, 8], 5) == ([1, 2, 8], 1)


def test_tree_inputs_mask_ancestors_only():
    # root -> a -> b ; root -> c ; a -> d
    draft = Draft([10, 11, 12, 13], [-1, 0, -1, 0])
    depth, mask = draft.tree_inputs()
    assert depth.tolist() == [0, 1, 2, 1, 2]
    expected = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 1, 0, 0, 1]], bool)
    assert (mask == expected).all()
    with pytest.raises(ValueError, match="parents must come first"):
        Draft([1, 2], [1, -1]).tree_inputs()


def test_accept_walks_the_target_choices():
    draft = Draft([10, 11, 12, 13], [-1, 0, -1, 0])
    logits = np.zeros((5, 20))
    logits[0, 10] = logits[1, 13] = logits[4, 7] = 1  # root picks a, a picks d, d picks 7
    assert accept(draft, logits, lambda row: int(np.argmax(row))) == ([0, 1, 4], [10, 13, 7])
    logits[0] = 0
    logits[0, 3] = 1  # no child holds 3: only the target's own token
    assert accept(draft, logits, lambda row: int(np.argmax(row))) == ([0], [3])


def test_keep_rows_moves_the_accepted_path_down(tiny):
    target = Model(tiny("llama")[0]).target
    for cache in (*target.key_cache, *target.value_cache):
        cache[...] = np.arange(cache.shape[2])[None, None, :, None]
    target.keep_rows(10, [0, 1, 4, 6])
    for cache in (*target.key_cache, *target.value_cache):
        assert cache[0, 0, 10:14, 0].tolist() == [10, 11, 14, 16]


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "int8"])
def test_quantized_rows_round_alike_whatever_the_row_count(tiny, kv_dtype):
    """One-token steps and multi-token verifies must agree bit for bit, or a verify could
    pick another token than plain decoding would (MatMulNBits' one-row kernel differs), at
    every KV cache format."""
    for dtype in ("int4", "int8", "fp32"):
        target = Model(tiny("llama", dtype=dtype, kv_dtype=kv_dtype)[0]).target
        target.prefill(list(range(3, 40)))
        rows = [7, 9, 11, 13, 15, 17]
        many = target.forward(rows, np.arange(37, 43), causal_mask(6), 37).copy()
        for i, token in enumerate(rows):
            one = target.forward([token], [37 + i], np.ones((1, 1), bool), 37 + i)
            assert np.array_equal(one[0], many[i]), (dtype, i)


def prompts():
    return [[5 + i % 9 for i in range(40)],  # repetitive: lookup finds drafts
            list(range(4, 70, 3)), [7, 30, 2 + 1, 90, 41]]


@pytest.mark.parametrize("arch,dtype,kv_dtype", [("llama", "fp32", "fp32"), ("qwen3", "fp32", "fp32"),
                                                 ("llama", "int4", "fp32"), ("llama", "int4", "int8"),
                                                 ("qwen3", "fp32", "fp16")])
def test_greedy_is_lossless_for_every_drafter(spec_bundle, arch, dtype, kv_dtype):
    model = Model(spec_bundle(arch, dtype, kv_dtype))
    assert set(model.drafters) == {"lookup", "self-int8", "self-int8-tree", "draft-lm", "draft-lm-tree"}
    for ids in prompts():
        plain = model.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True)
        for drafter in model.drafters:
            for draft_len in (None, 1, 4):
                spec = model.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True,
                                      drafter=drafter, draft_len=draft_len)
                assert spec.tokens == plain.tokens, (drafter, draft_len)
                assert sum(spec.stats.accept_hist) == spec.stats.steps


def test_self_drafter_is_accepted_and_saves_steps(spec_bundle):
    model = Model(spec_bundle())
    ids = prompts()[1]
    plain = model.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True)
    for drafter in ("self-int8", "self-int8-tree"):
        spec = model.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True, drafter=drafter, draft_len=4)
        assert spec.tokens == plain.tokens
        assert spec.stats.steps < plain.stats.steps / 2  # int8 drafts of the same model mostly pass
        assert spec.stats.mean_accept_len > 2


def test_tree_side_branches_are_accepted_and_compacted(spec_bundle, monkeypatch):
    """The draft-lm drafter (another model) is often wrong: side branches then carry the
    step, and their rows must be moved into place for the output to stay exact."""
    import dflash.runtime.speculative as speculative

    side_taken = []
    original = speculative.accept

    def spy(draft, logits, pick):
        rows, new = original(draft, logits, pick)
        side_taken.append(any(rows[i] != i for i in range(len(rows))))
        return rows, new

    monkeypatch.setattr(speculative, "accept", spy)
    model = Model(spec_bundle())
    for ids in prompts():
        plain = model.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True)
        spec = model.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True, drafter="draft-lm-tree", draft_len=3)
        assert spec.tokens == plain.tokens
    assert any(side_taken)


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "int8"])
def test_stops_at_capacity_without_writing_past_it(spec_bundle, kv_dtype):
    model = Model(spec_bundle(kv_dtype=kv_dtype))
    ids = [5 + i % 4 for i in range(100)]
    plain = model.generate(input_ids=ids, max_new_tokens=29, ignore_eos=True)
    for drafter in ("lookup", "self-int8-tree"):
        spec = model.generate(input_ids=ids, max_new_tokens=29, ignore_eos=True, drafter=drafter, draft_len=16)
        assert spec.tokens == plain.tokens and len(spec.tokens) == 29


def test_drafts_fit_one_target_call(spec_bundle, monkeypatch):
    """A drafter is never offered more nodes than one verify call holds (MAX_ROWS rows with
    the root), however large the tree it would like to grow."""
    from dflash.runtime.drafters import LookupDrafter
    from dflash.runtime.speculative import Draft
    from dflash.runtime.target import MAX_ROWS

    offered = []

    def greedy_for_room(self, history, room):
        offered.append(room)
        return Draft([history[-1]] * room, list(range(-1, room - 1)))  # a chain as long as allowed

    monkeypatch.setattr(LookupDrafter, "propose", greedy_for_room)
    model = Model(spec_bundle())
    ids = [5 + i % 4 for i in range(20)]
    plain = model.generate(input_ids=ids, max_new_tokens=30, ignore_eos=True)
    spec = model.generate(input_ids=ids, max_new_tokens=30, ignore_eos=True, drafter="lookup")
    assert spec.tokens == plain.tokens
    assert max(offered) == MAX_ROWS - 1


def test_eos_inside_an_accepted_run_ends_there(spec_bundle):
    model = Model(spec_bundle())
    ids = prompts()[1]
    free = model.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True).tokens
    model.eos_ids = {free[10]}  # pretend the 11th token is EOS
    stop_at = free.index(free[10]) + 1
    for drafter in (None, "self-int8"):
        result = model.generate(input_ids=ids, max_new_tokens=40, drafter=drafter, draft_len=6)
        assert result.tokens == free[:stop_at] and result.finish_reason == "stop"


def test_sampling_is_seed_for_seed_identical(spec_bundle):
    """Sample-and-match draws the target's token at each row in order, so with the same
    seed it reproduces plain sampling exactly (not only in distribution)."""
    model = Model(spec_bundle())
    ids = prompts()[2]
    for seed in range(20):
        options = dict(input_ids=ids, max_new_tokens=12, temperature=0.8, top_p=0.9, seed=seed, ignore_eos=True)
        plain = model.generate(**options)
        for drafter in ("self-int8", "self-int8-tree", "lookup"):
            assert model.generate(drafter=drafter, draft_len=3, **options).tokens == plain.tokens


def chi_square_p_below(a: collections.Counter, b: collections.Counter, alpha: float) -> tuple[float, float]:
    """Chi-square homogeneity statistic of two samples (cells with expected count < 5 merged)
    and its critical value at `alpha` (Wilson-Hilferty approximation)."""
    n_a, n_b = sum(a.values()), sum(b.values())
    cells, other = [], [0, 0]
    for key in set(a) | set(b):
        counts = [a[key], b[key]]
        if min(sum(counts) * n_a, sum(counts) * n_b) / (n_a + n_b) < 5:
            other = [other[0] + counts[0], other[1] + counts[1]]
        else:
            cells.append(counts)
    if sum(other):
        cells.append(other)
    stat = 0.0
    for count_a, count_b in cells:
        total = count_a + count_b
        for count, n in ((count_a, n_a), (count_b, n_b)):
            expected = total * n / (n_a + n_b)
            stat += (count - expected) ** 2 / expected
    df = len(cells) - 1
    z = {0.001: 3.090, 0.01: 2.326}[alpha]
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampling_distribution_matches_plain_sampling(spec_bundle, temperature, top_p):
    """Spec and plain sampling from independent seeds: the tokens at the positions the verify
    decides (2nd and 3rd) follow the same distribution, chi-square at alpha = 0.001.

    With 4000 samples per side the test has power: moving 5% of the probability mass (the
    spec side with every 20th sample's token replaced) is rejected."""
    model = Model(spec_bundle())
    ids, n = prompts()[2], 4000
    options = dict(input_ids=ids, max_new_tokens=3, temperature=temperature, top_p=top_p, ignore_eos=True)
    plain = [model.generate(seed=seed, **options).tokens for seed in range(n)]
    spec = [model.generate(seed=n + seed, drafter="self-int8-tree", draft_len=2, **options).tokens
            for seed in range(n)]
    for position in (1, 2):
        a = collections.Counter(t[position] for t in plain)
        b = collections.Counter(t[position] for t in spec)
        stat, critical = chi_square_p_below(a, b, 0.001)
        assert stat < critical, (position, stat, critical)
        top = a.most_common(1)[0][0]
        shifted = collections.Counter(top if i % 20 == 0 else t[position] for i, t in enumerate(spec))
        shifted_stat, _ = chi_square_p_below(a, shifted, 0.001)
        assert shifted_stat > critical, (position, shifted_stat, critical)


def test_policy_drafts_more_when_acceptance_is_high():
    cost = VerifyCost({1: 20.0, 2: 21.0, 4: 24.0, 8: 30.0, 16: 44.0, 25: 60.0})
    policy = Policy(cost)
    good, bad = Acceptance(), Acceptance()
    for _ in range(50):
        good.observe(8, 8)
        bad.observe(2, 0)
    assert policy.chain_length(good, 0.0, 20) >= 8
    assert policy.chain_length(bad, 0.0, 20) <= 1
    assert policy.chain_length(good, 15.0, 20) < policy.chain_length(good, 1.0, 20)
    assert Policy(cost, fixed=5).chain_length(bad, 0.0, 20) == 5
    assert Policy(cost, fixed=5).chain_length(bad, 0.0, 3) == 3


def _acceptance(accepted_of_2: float) -> Acceptance:
    """Rates near accepted_of_2 / 2 at every depth (chains of 2 with that many taken on average)."""
    acceptance = Acceptance()
    for i in range(200):
        acceptance.observe(2, int(accepted_of_2 * (i + 1)) - int(accepted_of_2 * i))
    return acceptance


def test_policy_drafts_beside_a_copy_only_what_adds_to_it():
    dear_rows = VerifyCost({1: 3.6, 2: 4.0, 4: 4.8, 8: 7.2, 16: 12.0, 25: 17.0})  # int4-like
    drafter = _acceptance(0.8)  # right 40% of the time
    assert Policy(dear_rows).chain_length(drafter, 0.0, 15, fixed_ms=0.5) >= 1  # alone it pays
    reliable_copy = Beside(rows=5, tokens=1 + 0.9 + 0.81 + 0.73 + 0.66, share=0.1)
    assert Policy(dear_rows).chain_length(drafter, 0.0, 15, fixed_ms=0.5, beside=reliable_copy) == 0
    weak_copy = Beside(rows=2, tokens=1.1, share=0.9)
    assert Policy(dear_rows).chain_length(drafter, 0.0, 15, fixed_ms=0.5, beside=weak_copy) >= 1


class _RecordingDrafter(Drafter):
    """Drafts [5, 6] and records what the hybrid asked it for."""

    def __init__(self, policy):
        super().__init__(policy)
        self.asked = []

    def propose(self, history, room, beside=Beside()):
        self.asked.append((room, beside))
        self.main = [0, 1]
        return Draft.chain([5, 6])


def test_hybrid_plans_the_copy_first_and_the_drafter_beside_it():
    policy = Policy(VerifyCost({1: 20.0, 2: 20.5, 25: 30.0}))
    inner = _RecordingDrafter(policy)
    hybrid = HybridDrafter(policy, inner, LookupDrafter(policy))
    repeating = [1, 2, 3, 4, 9, 9, 1, 2, 3]  # the last 3-gram was followed by 4, 9, 9, 1, ...
    draft = hybrid.propose(repeating, room=40)
    room, beside = inner.asked[-1]
    copied = len(hybrid.copied)
    assert copied >= 1 and room == MAX_DRAFT - copied
    assert beside.rows == 1 + copied and 1 < beside.tokens < 1 + copied and 0 < beside.share < 1
    assert draft.tokens == [5, 6] + repeating[3:3 + copied] and draft.parents[2] == -1  # its own branch
    hybrid.propose([1, 2, 3, 4, 5, 6, 7], room=40)  # nothing to copy: the drafter is alone
    assert inner.asked[-1] == (MAX_DRAFT, Beside()) and hybrid.copied == []


def test_unknown_drafter_is_refused_with_the_list(tiny):
    model = Model(tiny("llama")[0])
    with pytest.raises(ValueError, match="no drafter 'self-int4'.*lookup.*dflash-export draft-lm"):
        model.generate("the", max_new_tokens=4, drafter="self-int4")
    with pytest.raises(ValueError, match="no drafter 'dflash-hybrid'.*`dflash-export drafter default --target"):
        model.generate("the", max_new_tokens=4, drafter="dflash-hybrid")


def test_draft_model_with_another_tokenizer_is_refused(spec_bundle, tmp_path):
    from dflash.export.cli import export_draft_lm
    from dflash.export.sources import SourceError
    from tiny_models import save_model_folder

    bundle = tmp_path / "bundle"
    shutil.copytree(spec_bundle(), bundle)
    other = save_model_folder("llama", tmp_path / "other_vocab", vocab_size=300)
    with pytest.raises(SourceError, match="another tokenizer than the target.*must share"):
        export_draft_lm(str(other), bundle)
    # A bundle edited by hand is refused at load, before any token is drafted.
    shutil.copy(other / "tokenizer.json", bundle / "draft-lm" / "tokenizer.json")
    with pytest.raises(BundleError, match="another tokenizer than the target"):
        Model(bundle).generate("the", max_new_tokens=4, drafter="draft-lm")


def test_speculation_is_refused_on_attention_that_is_not_batch_invariant(tiny):
    model = Model(tiny("llama", attention="gqa")[0])
    assert model.drafters == []
    with pytest.raises(ValueError, match="re-export it with `dflash-export target SRC --attention custom`"):
        model.generate(input_ids=[5, 6, 7], max_new_tokens=4, drafter="lookup")
