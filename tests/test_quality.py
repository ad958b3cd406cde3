"""dflash-bench quality: perplexity and agreement between precisions, scored through the runtime."""

import json

import numpy as np
from click.testing import CliRunner


def test_quality_scores_every_bundle_against_the_first(tiny, tmp_path):
    from dflash.bench.cli import main

    fp32, _ = tiny("llama")
    int8, _ = tiny("llama", dtype="int8")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 12)  # longer than one 64-row call
    out = tmp_path / "quality.json"
    result = CliRunner().invoke(main, ["quality", "--bundle", str(fp32), "--bundle", str(int8), "--text", str(text),
                                       "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert [r["dtype"] for r in rows] == ["fp32", "int8"]
    assert rows[0]["agreement"] == 1.0 and 0 <= rows[1]["agreement"] <= 1
    assert rows[0]["kl_divergence"] == 0.0 and 0 < rows[1]["kl_divergence"] < 0.1  # int8 moves it a little
    assert all(np.isfinite(r["perplexity"]) and r["perplexity"] > 1 for r in rows)
    assert rows[0]["tokens"] > 64 and "perplexity" in result.output


def test_kl_divergence_is_that_of_the_two_distributions(tiny):
    from dflash.bench.quality import Scores, score
    from dflash.runtime import Model

    fp32, int8 = Model(tiny("llama")[0]), Model(tiny("llama", dtype="int8")[0])
    ids = list(range(5, 40))
    first = Scores(len(ids) - 1, keep=None)
    first.all = np.stack([np.log(softmax(r)) for r in fp32.target.forward(ids[:-1], np.arange(34), np.tri(34, dtype=bool), 0)])
    _, _, kl = score(int8, ids, reference=first)
    logits = int8.target.forward(ids[:-1], np.arange(34), np.tri(34, dtype=bool), 0)
    p, q = np.exp(first.all), np.stack([softmax(r) for r in logits])
    np.testing.assert_allclose(kl, (p * np.log(p / q)).sum(-1).mean(), rtol=1e-4)


def softmax(row):
    e = np.exp(row.astype(np.float64) - row.max())
    return e / e.sum()


def test_score_matches_a_plain_softmax(tiny):
    from dflash.bench.quality import score
    from dflash.runtime import Model

    model = Model(tiny("llama")[0])
    ids = list(range(5, 40))
    logprobs, argmax = score(model, ids)
    logits = model.target.forward(ids[:-1], np.arange(len(ids) - 1), np.tri(len(ids) - 1, dtype=bool), 0)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(logprobs, np.log(probs[np.arange(len(ids) - 1), ids[1:]]), atol=1e-5)
    assert (argmax == logits.argmax(-1)).all()


def test_a_long_text_is_scored_in_windows_from_an_empty_cache(tiny):
    from dflash.bench.quality import score
    from dflash.runtime import Model

    model = Model(tiny("llama")[0])  # 128 rows of cache
    ids = [5 + i % 50 for i in range(300)]
    logprobs, argmax = score(model, ids, window=100)
    assert len(logprobs) == len(argmax) == len(ids) - 1  # every next token once
    # windows overlap by one token: the second starts at token 99, with nothing cached before it
    second, _ = score(model, ids[99:199], window=100)
    np.testing.assert_allclose(logprobs[99:198], second, atol=1e-6)
    assert len(score(model, ids)[0]) == len(ids) - 1  # the default window is capped at the cache
