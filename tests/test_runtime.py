"""The runtime's API: bad input, sampling, stop strings, streaming, chat templates."""

import json
import shutil
import subprocess
import sys

import pytest

from dflash.runtime import BundleError, Model, SamplingParams
from dflash.runtime.text import StopMatcher, StreamDecoder, TextCodec


@pytest.fixture(scope="module")
def model(tiny):
    return Model(tiny("llama")[0])


def copy_bundle(tiny, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(tiny("llama")[0], dst)
    return dst


def test_runtime_imports_without_torch():
    code = "import dflash.runtime, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_bundle_folder(tmp_path):
    with pytest.raises(BundleError, match="does not exist"):
        Model(tmp_path / "nope")


def test_missing_manifest(tmp_path):
    with pytest.raises(BundleError, match="dflash.json is missing"):
        Model(tmp_path)


def test_newer_format_version(tiny, tmp_path):
    bundle = copy_bundle(tiny, tmp_path)
    manifest = json.loads((bundle / "dflash.json").read_text())
    manifest["format_version"] = 99
    (bundle / "dflash.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="format version 99.*upgrade dflash-ort"):
        Model(bundle)


@pytest.mark.parametrize("name", ["target.onnx", "target.onnx.data", "tokenizer.json"])
def test_missing_bundle_file(tiny, tmp_path, name):
    bundle = copy_bundle(tiny, tmp_path)
    (bundle / name).unlink()
    with pytest.raises(BundleError, match=name.replace(".", r"\.")):
        Model(bundle)


def test_prompt_longer_than_capacity(model):
    with pytest.raises(ValueError, match="holds 128 in all.*truncate='left'"):
        model.generate(input_ids=[5] * 128, max_new_tokens=1)


def test_prompt_truncated_on_the_left_on_request(model):
    ids = [5 + i % 50 for i in range(300)]
    result = model.generate(input_ids=ids, max_new_tokens=8, ignore_eos=True, truncate="left")
    kept = model.generate(input_ids=ids[-120:], max_new_tokens=8, ignore_eos=True)
    assert result.stats.prompt_tokens == 120 and result.tokens == kept.tokens
    with pytest.raises(ValueError, match="truncate must be None or 'left'"):
        model.generate(input_ids=ids, truncate="right")


def test_max_new_tokens_past_capacity_stops_with_length(model):
    """100 prompt tokens in a 128-row cache leave room for 29 new tokens (the last is never fed back)."""
    full = model.generate(input_ids=[5] * 100, max_new_tokens=40, ignore_eos=True)
    assert len(full.tokens) == 29 and full.finish_reason == "length"
    assert model.generate(input_ids=[5] * 100, max_new_tokens=29, ignore_eos=True).tokens == full.tokens


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"temperature": 1.0, "top_p": 0.0}, r"top_p must lie in \(0, 1\]"),
    ({"temperature": 1.0, "top_p": 1.5}, r"top_p must lie in \(0, 1\]"),
    ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
])
def test_invalid_generation_parameters(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model.generate("the fox", **kwargs)


def test_empty_prompt(model):
    with pytest.raises(ValueError, match="empty"):
        model.generate("")


def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    ids = [10, 20, 30]
    a = model.generate(input_ids=ids, max_new_tokens=16, temperature=1.0, seed=7, ignore_eos=True).tokens
    b = model.generate(input_ids=ids, max_new_tokens=16, temperature=1.0, seed=7, ignore_eos=True).tokens
    c = model.generate(input_ids=ids, max_new_tokens=16, temperature=1.0, seed=8, ignore_eos=True).tokens
    greedy = model.generate(input_ids=ids, max_new_tokens=16, ignore_eos=True).tokens
    top1 = model.generate(input_ids=ids, max_new_tokens=16, temperature=0.8, top_k=1, seed=3, ignore_eos=True).tokens
    assert a == b and a != c and top1 == greedy


def test_top_p_keeps_the_smallest_set_reaching_p():
    import numpy as np

    from dflash.runtime.sampling import probabilities

    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.75))
    np.testing.assert_allclose(p, [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=3))
    np.testing.assert_allclose(p, np.array([0.5, 0.3, 0.15, 0]) / 0.95)


def _full_sort_probabilities(logits, params):
    """The specification the fast top-p path must equal: a stable sort of the whole vocabulary."""
    import numpy as np

    z = logits.astype(np.float64) / params.temperature
    if params.top_k:
        z = np.where(z >= np.sort(z)[-params.top_k], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1:
        order = np.argsort(-p, kind="stable")
        keep = order[: np.searchsorted(np.cumsum(p[order]), params.top_p) + 1]
        p = np.where(np.isin(np.arange(p.size), keep), p, 0.0)
        p /= p.sum()
    return p


@pytest.mark.parametrize("vocab, scale, rounded", [(7, 1.0, False), (49152, 3.0, False), (49152, 3.0, True),
                                                   (49152, 2.0, False), (49152, 0.01, False)])
def test_sampling_equals_a_full_sort_and_generator_choice(vocab, scale, rounded):
    """Partial sorts (ties at the threshold; scale 2 needs 8192 candidates, a flat distribution the
    whole vocabulary) keep the same set, and the draw matches Generator.choice draw for draw."""
    import numpy as np

    from dflash.runtime.sampling import Sampler, probabilities

    logits = (np.random.default_rng(vocab).standard_normal(vocab) * scale).astype(np.float32)
    logits = np.round(logits, 1) if rounded else logits
    for params in (SamplingParams(0.7, seed=1), SamplingParams(0.7, top_p=0.95, seed=2),
                   SamplingParams(1.3, top_p=0.5, seed=3), SamplingParams(0.8, top_k=5, top_p=0.9, seed=4)):
        expected = _full_sort_probabilities(logits, params)
        np.testing.assert_allclose(probabilities(logits, params), expected, rtol=1e-12, atol=0)
        sampler, reference = Sampler(params), np.random.default_rng(params.seed)
        assert [sampler(logits) for _ in range(30)] == [int(reference.choice(vocab, p=expected)) for _ in range(30)]


def test_stop_string_ends_the_text(model):
    full = model.generate("the quick", max_new_tokens=40, ignore_eos=True)
    assert len(full.text) > 10
    stop = full.text[6:9]
    cut = model.generate("the quick", max_new_tokens=40, ignore_eos=True, stop=[stop])
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason == "stop" and len(cut.tokens) < len(full.tokens)


def test_stop_string_spanning_pieces():
    matcher = StopMatcher(["<end>"])
    out = []
    for piece in ["hello <", "en", "d> more"]:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "hello " and stopped
    matcher = StopMatcher(["<end>"])
    assert matcher.feed("a <e")[0] == "a " and matcher.feed("x")[0] == "<ex" and matcher.flush() == ""


def test_stream_pieces_join_to_the_text_and_finish_reason(model):
    generation = model.stream("the lazy dog", max_new_tokens=20, ignore_eos=True)
    pieces = list(generation)
    assert "".join(pieces) == generation.result.text
    assert generation.result.finish_reason == "length" and len(generation.result.tokens) == 20


def test_stream_never_splits_a_character(tiny):
    codec = TextCodec(Model(tiny("llama")[0]).bundle)
    text = "héllo wörld ✓ 日本語 🙂 done"
    ids = codec.tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text.encode()) // 2  # byte pieces: many characters span tokens
    decoder = StreamDecoder(codec)
    pieces = [decoder.push([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_chat_template_matches_transformers(tiny):
    from transformers import AutoTokenizer

    bundle, hf = tiny("llama")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the fox?"}]
    expected = AutoTokenizer.from_pretrained(hf).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert Model(bundle).encode(messages=messages) == list(expected)


def test_generation_from_two_places_at_once_is_refused(model):
    first = iter(model.stream("the", max_new_tokens=5))
    next(first, None)
    with pytest.raises(RuntimeError, match="already generating"):
        model.generate("the", max_new_tokens=2)
    list(first)
    assert model.generate("the", max_new_tokens=2).finish_reason in ("stop", "length")


def test_huge_page_ranges_are_the_new_and_grown_mappings():
    from dflash.runtime.session import _grown

    before = {0x1000: 0x5000, 0x9000: 0xA000}
    after = {0x1000: 0x8000, 0x9000: 0xA000, 0x20000: 0x40000}  # heap grew, one new mapping
    assert sorted(_grown(before, after)) == [(0x5000, 0x8000), (0x20000, 0x40000)]
