"""dflash-train: the block attention mask, the prompt set, and data -> fit -> resume -> export
-> lossless decoding end to end on a tiny target, in seconds."""

import json
import random

import pytest
import torch

from conftest import SHARED_PROMPTS


def test_block_mask_matches_a_brute_force_construction():
    from dflash.export.train import block_mask

    length, block, anchors = 11, 4, [2, 5, 9]
    mask = block_mask(length, anchors, block)
    for row in range(len(anchors) * block):
        j = row // block
        for col in range(length + len(anchors) * block):
            if col < length:
                expected = col < anchors[j]  # context strictly before the anchor
            else:
                expected = (col - length) // block == j  # its own block only, both directions
            assert bool(mask[row, col]) == expected, (row, col)


def test_prompt_set_covers_every_kind_and_is_not_the_eval_set():
    from dflash.export.train_data import build_prompts

    prompts = build_prompts(100)
    assert {p["kind"] for p in prompts} == {"chat", "code", "math", "list", "grounded"}
    assert len({p["messages"][0]["content"] for p in prompts}) > 80
    assert build_prompts(100) == prompts  # deterministic for a seed
    if SHARED_PROMPTS.is_file():
        evaluation = {json.loads(line)["messages"][0]["content"] for line in SHARED_PROMPTS.read_text().splitlines()
                      if line.strip()}
        assert not evaluation & {p["messages"][0]["content"] for p in prompts}


def test_targets_and_anchors_stay_inside_the_answer():
    from dflash.export.train import block_targets, sample_anchors

    tokens = torch.arange(100, 120)
    anchors = sample_anchors(12, 20, 50, random.Random(0))
    assert anchors == list(range(11, 19))
    targets = block_targets(tokens, [17, 18], 4)
    assert targets.tolist() == [[118, 119, -100], [119, -100, -100]]
    vocab_map = torch.full((200,), -1)
    vocab_map[118] = 0
    assert block_targets(tokens, [17], 4, vocab_map).tolist() == [[0, -100, -100]]


def test_data_fit_resume_export_and_decode(tmp_path):
    from dflash.export import sources
    from dflash.export.cli import export_dflash, export_target
    from dflash.export.train import train
    from dflash.export.train_data import build_prompts, generate
    from dflash.runtime import Model
    from tiny_models import save_model_folder

    hf = save_model_folder("qwen3", tmp_path / "hf", layers=8)
    export_target(str(hf), tmp_path / "bundle", max_len=256)
    prompts = build_prompts(10)
    path = generate(sources.load(str(hf)), prompts[:6], tmp_path / "data", 20, 3, echo=lambda m: None)
    generate(sources.load(str(hf)), prompts, tmp_path / "data", 20, 3, echo=lambda m: None)  # resumes
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in rows] == [p["id"] for p in prompts]

    options = dict(layers=1, block=8, draft_vocab=120, minutes=5, anchors=8, echo=lambda m: None)
    first = train(tmp_path / "bundle", tmp_path / "data", tmp_path / "drafter", max_steps=20, **options)
    assert first["step"] == 20 and first["history"]
    later = train(tmp_path / "bundle", tmp_path / "data", tmp_path / "drafter", max_steps=30, resume=True, **options)
    assert later["step"] == 30 and len(later["history"]) == len(first["history"]) + 1
    assert later["history"][-1]["loss"] < first["history"][0]["loss"] + 1.0

    export_dflash(tmp_path / "drafter", tmp_path / "bundle")
    model = Model(tmp_path / "bundle")
    ids = list(range(4, 70, 3))
    plain = model.generate(input_ids=ids, max_new_tokens=30, ignore_eos=True)
    for drafter in ("dflash", "dflash-tree"):
        assert model.generate(input_ids=ids, max_new_tokens=30, ignore_eos=True, drafter=drafter).tokens == plain.tokens


def test_missing_data_is_a_clear_error(tmp_path):
    import click

    from dflash.export.train import load_sequences

    with pytest.raises(click.ClickException, match="run `dflash-train data` first"):
        load_sequences(tmp_path)
