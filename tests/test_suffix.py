"""The `suffix` drafter: drafts from a corpus of the target's earlier answers (runtime/suffix.py),
the same as a brute-force scan of the corpus, lossless in the loop, and a corpus from another
target refused at export; the answer memory, which drafts a repeated request from its last answer."""

from __future__ import annotations

import shutil

import click
import numpy as np
import pytest

from dflash.runtime import Model
from dflash.runtime.suffix import DRAFT, KEEP, ORDERS, RECITE, SuffixIndex
from dflash.train import shards


def scanned_draft(answers, history):
    """What the index must draft, by scanning every answer: for the longest suffix of `history`
    (ORDERS) that occurs with something after it, the latest KEEP occurrences vote token by token
    (ties: the oldest occurrence's token)."""
    for n in ORDERS:
        if len(history) < n:
            continue
        follows = [a[e:e + DRAFT] for a in answers for e in range(n, len(a)) if a[e - n:e] == history[-n:]]
        if follows:
            follows, out = follows[-KEEP:], []
            while True:
                depth = len(out)
                firsts = [f[depth] for f in follows if len(f) > depth]
                if depth == DRAFT or not firsts:
                    return out
                token = max(firsts, key=lambda t: (firsts.count(t), -firsts.index(t)))
                out.append(token)
                follows = [f for f in follows if len(f) > depth and f[depth] == token]
    return []


def random_answers(rng, n=60, vocab=12):
    """Short answers over a small vocabulary: suffixes repeat, with varied continuations."""
    return [rng.integers(0, vocab, int(rng.integers(1, 40))).tolist() for _ in range(n)]


def test_drafts_are_those_of_a_scan_of_the_corpus():
    rng = np.random.default_rng(0)
    answers = random_answers(rng, n=200, vocab=6)  # 2-token suffixes occur more than KEEP times
    index = SuffixIndex.from_answers(answers)
    drafted = 0
    for _ in range(400):
        history = rng.integers(0, 6, int(rng.integers(0, 12))).tolist()
        assert index.draft(history) == scanned_draft(answers, history), history
        drafted += bool(index.draft(history))
    assert drafted > 300  # most histories end in a suffix the corpus holds
    assert index.draft([99, 98, 97]) == []  # tokens the corpus never saw


def test_continuations_stop_at_the_end_of_an_answer():
    index = SuffixIndex.from_answers([[1, 2, 3, 4], [7, 1, 2, 9, 9, 9, 9, 9, 9, 9, 9, 9]])
    assert index.draft([5, 3, 4]) == []  # 3 4 ends an answer: nothing follows
    assert index.draft([1, 2]) == [3, 4]  # a tie goes to the oldest occurrence
    assert index.draft([7, 1, 2]) == [9] * 8  # the longer suffix decides


def write_answers(folder, answers):
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"id": i, "kind": "test", "source": "test", "messages": [], "ended": True, "answer": a,
             "greedy": a} for i, a in enumerate(answers)]
    shards.write(folder / "shard-00000.npz", rows)


@pytest.fixture(scope="module")
def corpus_bundle(tiny, tmp_path_factory):
    """A tiny target whose corpus holds its own greedy answers to other prompts."""
    from dflash.export.cli import export_corpus

    folder = tmp_path_factory.mktemp("suffix") / "bundle"
    shutil.copytree(tiny("llama")[0], folder)
    model = Model(folder)
    answers = [model.generate(input_ids=[3 + i, 40 - i, 17], max_new_tokens=60, ignore_eos=True).tokens
               for i in range(6)]
    write_answers(folder.parent / "answers", answers)
    manifest = export_corpus([folder.parent / "answers"], folder)
    assert manifest["suffix_corpus"]["answers"] == 6
    return folder


def test_suffix_drafter_is_lossless_and_saves_steps(corpus_bundle):
    model = Model(corpus_bundle)
    assert "suffix" in model.drafters
    for ids in ([3, 40, 17], [9, 2, 50, 61], list(range(4, 70, 3))):
        plain = model.generate(input_ids=ids, max_new_tokens=60, ignore_eos=True)
        for drafter in ("suffix", "lookup"):
            spec = model.generate(input_ids=ids, max_new_tokens=60, ignore_eos=True, drafter=drafter)
            assert spec.tokens == plain.tokens, (drafter, ids)
    # A prompt whose answer the corpus holds: the drafts are accepted.
    plain = model.generate(input_ids=[4, 39, 17], max_new_tokens=60, ignore_eos=True)
    spec = model.generate(input_ids=[4, 39, 17], max_new_tokens=60, ignore_eos=True, drafter="suffix")
    assert spec.tokens == plain.tokens and spec.stats.steps < plain.stats.steps / 2


def test_missing_corpus_names_the_export_command(tiny):
    with pytest.raises(ValueError, match="dflash-export corpus ANSWERS_FOLDER"):
        Model(tiny("llama")[0]).generate(input_ids=[3, 4], max_new_tokens=4, drafter="suffix")


def test_answers_of_another_target_are_refused(tiny, tmp_path):
    from dflash.export.cli import corpus

    folder = tmp_path / "bundle"
    shutil.copytree(tiny("llama")[0], folder)
    write_answers(tmp_path / "answers", [[1, 2, 60000]])
    with pytest.raises(click.ClickException, match="written by another target"):
        corpus.callback((tmp_path / "answers",), folder)


def test_one_window_hashes_as_the_index_hashes_it():
    from dflash.runtime.suffix import _hash, _hash_one

    windows = np.random.default_rng(0).integers(0, 1 << 17, (200, 8))
    for n in (2, 3, 8):
        assert [_hash_one(w[:n].tolist()) for w in windows] == _hash(windows[:, :n]).tolist()


def test_answer_memory_keeps_the_latest_answers_up_to_its_size():
    from dflash.runtime.suffix import AnswerMemory

    memory = AnswerMemory(10)
    assert memory.match([1, 2]) == ([], 0)
    memory.add([1, 2, 3, 4, 5, 6])
    assert memory.match([9, 1, 2]) == ([3, 4, 5, 6], 2)
    assert memory.match([1, 2, 3, 4]) == ([5, 6], 4)
    memory.add([7, 8, 9, 10, 11])  # 11 tokens held: the first answer goes
    assert memory.held == 5 and memory.match([1, 2]) == ([], 0) and memory.match([7, 8]) == ([9, 10, 11], 2)
    memory.add([0])  # too short to continue anything: not kept
    assert memory.held == 5
    memory.clear()
    assert memory.match([7, 8]) == ([], 0)
    with pytest.raises(ValueError, match="at least 1 token"):
        AnswerMemory(0)
    long = AnswerMemory(100)
    long.add(list(range(40)))
    assert long.match([0, 1]) == (list(range(2, 2 + RECITE)), 2)  # recited further than a corpus draft


def test_a_repeated_request_is_drafted_from_its_last_answer(tiny):
    """With answer_memory, `suffix` exists on a bundle without a corpus, drafts a repeated request
    from the answer it wrote before (lossless, far fewer steps), and remembers only what it served."""
    model = Model(tiny("llama")[0], answer_memory=4096)
    assert "suffix" in model.drafters and "suffix" not in Model(tiny("llama")[0]).drafters
    ids = [5, 31, 8, 77, 12]
    plain = model.generate(input_ids=ids, max_new_tokens=60, ignore_eos=True)  # plain decoding: nothing remembered
    first = model.generate(input_ids=ids, max_new_tokens=60, ignore_eos=True, drafter="suffix")
    again = model.generate(input_ids=ids, max_new_tokens=60, ignore_eos=True, drafter="suffix")
    assert first.tokens == again.tokens == plain.tokens
    assert again.stats.steps < first.stats.steps / 3, (first.stats.steps, again.stats.steps)
    model.forget_answers()
    forgotten = model.generate(input_ids=ids, max_new_tokens=60, ignore_eos=True, drafter="suffix")
    assert forgotten.tokens == plain.tokens and forgotten.stats.steps > 2 * again.stats.steps  # not recited
    sampled = [model.generate(input_ids=ids, max_new_tokens=40, temperature=1.0, seed=3, ignore_eos=True,
                              drafter=drafter).tokens for drafter in (None, "suffix", "suffix")]
    assert sampled[0] == sampled[1] == sampled[2]
    with pytest.raises(ValueError, match="answer_memory is a number of tokens"):
        Model(tiny("llama")[0], answer_memory=-1)
