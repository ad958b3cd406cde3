"""DFlash drafters: z-lab checkpoints load and export, the ONNX drafter equals the torch
reference, the runtime loop matches a plain torch loop, and decoding stays lossless."""

import collections
import json
import os
import shutil

import numpy as np
import pytest
import torch

from dflash.runtime import Model
from dflash.runtime.dflash import DrafterSession
from test_speculative import chi_square_p_below

BLOCK = 16


def tiny_qwen3_dflash(base, copy: bool = False, kv_dtype: str = "fp32"):
    """A tiny 8-layer Qwen3 target (taps 1..5, its KV cache in kv_dtype) and a z-lab-shaped
    drafter: 5 taps, block 16, GQA."""
    from dflash.export.cli import export_dflash, export_target
    from tiny_models import save_dflash_folder, save_model_folder

    hf = save_model_folder("qwen3", base / "hf", layers=8)
    export_target(str(hf), base / "bundle", max_len=160, kv_dtype=kv_dtype)
    manifest = json.loads((base / "bundle" / "dflash.json").read_text())
    assert manifest["taps"] == [1, 2, 3, 4, 5]
    config = json.loads((hf / "config.json").read_text())
    drafter = save_dflash_folder(base / "drafter", config["hidden_size"], 8, manifest["taps"], config["vocab_size"],
                                 mask_token_id=3, block_size=BLOCK, layers=2, copy=copy)
    export_dflash(drafter, base / "bundle")
    return base / "bundle", hf, drafter


@pytest.fixture(scope="module")
def qwen3_dflash(tmp_path_factory):
    return tiny_qwen3_dflash(tmp_path_factory.mktemp("qwen3_dflash"))


@pytest.fixture(scope="module")
def qwen3_copy_dflash(tmp_path_factory):
    """The same with a copy-aware drafter (it reads lookup's copies of the block)."""
    return tiny_qwen3_dflash(tmp_path_factory.mktemp("qwen3_copy_dflash"), copy=True)


@pytest.fixture(scope="module")
def qwen3_int8kv_dflash(tmp_path_factory):
    """The same over a target whose KV cache stores int8 rows."""
    return tiny_qwen3_dflash(tmp_path_factory.mktemp("qwen3_int8kv_dflash"), kv_dtype="int8")


@pytest.fixture(scope="module")
def default_dflash(default_bundle, tmp_path_factory):
    """The default target (hard-linked copy) with a random drafter of its shape: 576 wide, 9/3 heads."""
    from dflash.export.cli import export_dflash
    from tiny_models import save_dflash_folder

    base = tmp_path_factory.mktemp("default_dflash")
    bundle = base / "bundle"
    shutil.copytree(default_bundle, bundle, copy_function=os.link,
                    ignore=shutil.ignore_patterns("self-*", "draft-lm", "drafter*"))
    manifest = json.loads((bundle / "dflash.json").read_text())
    manifest.pop("drafters", None)
    manifest.pop("dflash", None)
    manifest["graphs"].pop("drafter", None)
    (bundle / "dflash.json").unlink()  # a new file, not the linked one
    (bundle / "dflash.json").write_text(json.dumps(manifest))
    drafter = save_dflash_folder(base / "drafter", 576, 30, manifest["taps"], 49152, mask_token_id=2,
                                 block_size=BLOCK, layers=1, heads=9, kv_heads=3, head_dim=64, std=0.05)
    export_dflash(drafter, bundle)
    return bundle, drafter


def reference_for(bundle, drafter_folder):
    from dflash.export import sources
    from dflash.export.dflash import DFlashDrafter, Reference

    manifest = json.loads((bundle / "dflash.json").read_text())
    target = sources.load(manifest["source"]).model
    drafter = DFlashDrafter.load(drafter_folder)
    lm_head = target.lm_head.weight.detach().float().t()
    return Reference(drafter, target.get_input_embeddings().weight.detach().float(), lm_head, 4096), drafter.config


@pytest.mark.parametrize("which", ["qwen3", "qwen3_copy", "default"])
def test_ort_drafter_equals_torch_reference(which, request):
    """A run of steps as the loop makes them: the prompt's rows (more than one call's worth, so
    they are fed in chunks), then 1, B, 0, 3 and 20 new rows, some with a served block shorter
    than the trained one (and one asking for less than the smallest, which serves that); with
    lookup copies of every length the block may hold (a copy-aware drafter reads them)."""
    fixture = request.getfixturevalue(f"{which}_dflash")
    bundle, drafter_folder = fixture[0], fixture[-1]
    model = Model(bundle)
    session = DrafterSession(model.bundle)
    reference, config = reference_for(bundle, drafter_folder)
    assert session.copy == (which == "qwen3_copy") == config.copy
    rng = np.random.default_rng(0)
    width = len(config.target_layer_ids) * config.hidden_size
    past = 0
    assert DrafterSession.MAX_CONTEXT < 100
    for n, asked in ((100, None), (1, 3), (BLOCK, None), (0, 5), (3, 2), (20, None)):
        block = BLOCK if asked is None else max(asked, DrafterSession.MIN_BLOCK)
        features = rng.standard_normal((n, width)).astype(np.float32)
        anchor = int(rng.integers(0, config.vocab_size))
        copied = rng.integers(0, config.vocab_size, int(rng.integers(0, BLOCK))).tolist()
        logprobs, _ = session.run(features, anchor, past, block=asked, copied=copied)
        copy_ids = [-1] + copied[: block - 1] + [-1] * (block - 1 - len(copied[: block - 1]))
        expected = reference.step(torch.from_numpy(features), [anchor] + [config.mask_token_id] * (block - 1),
                                  past + n, copy_ids)
        assert len(logprobs) == block - 1
        assert np.abs(session.logits[0, : block - 1] - expected.numpy()).max() <= 1e-4, n
        top = torch.log_softmax(expected, -1).topk(session.top_ids.shape[-1], -1)
        assert np.abs(logprobs - top.values.numpy()).max() <= 1e-4
        past += n
        if n == 3:  # a refining pass: no new context, the block's rows hold drafts instead of masks
            drafts = rng.integers(0, config.vocab_size, block - 1)
            session.run(features[:0], anchor, past, block=asked, filled=drafts, copied=copied)
            expected = reference.step(torch.zeros(0, width), [anchor] + drafts.tolist(), past, copy_ids)
            assert np.abs(session.logits[0, : block - 1] - expected.numpy()).max() <= 1e-4


class BlockRecorder:
    """A stand-in drafter session that records the block each call asks for."""

    block, width, columns, refine, copy = BLOCK, 4, slice(None), False, False

    def __init__(self):
        self.blocks, self.calls = [], []

    def run(self, context, anchor, past, block=None, filled=None, copied=()):
        self.blocks.append(block)
        self.calls.append((len(context), past, None if filled is None else list(filled)))
        rows = (block or self.block) - 1
        return np.log(np.full((rows, 2), 0.5, np.float32)), np.full((rows, 2), len(self.calls), np.int64)


@pytest.mark.parametrize("draft_len, block", [(None, 4), (5, 6)])
def test_a_call_serves_only_the_block_positions_the_policy_may_use(draft_len, block):
    """Verify rows beyond 3 are dear here, so the adaptive plan is 2 drafts: the call drafts those
    and one more position (a block of 4 rows); a fixed draft length serves exactly that many."""
    from dflash.runtime.dflash import DFlashDrafter
    from dflash.runtime.policy import Policy, VerifyCost

    session = BlockRecorder()
    cost = VerifyCost({1: 1.0, 2: 1.1, 3: 1.2, 4: 3.0, 25: 30.0})
    drafter = DFlashDrafter(Policy(cost, draft_len), session)
    drafter.call_ms = 0.0
    draft = drafter.propose([7], room=20)
    assert session.blocks[-1] == block
    assert len(draft) <= block - 1


def test_a_refining_drafter_drafts_from_a_second_call_over_its_first_drafts():
    from dflash.runtime.dflash import DFlashDrafter
    from dflash.runtime.policy import Policy, VerifyCost

    session = BlockRecorder()
    session.refine = True
    drafter = DFlashDrafter(Policy(VerifyCost({1: 1.0, 25: 1.0}), 3), session)
    session.calls.clear()
    drafter.add_context(np.zeros((4, 4), np.float32))
    draft = drafter.propose([5, 6, 7, 8, 9], room=20)
    (rows, past, filled), (rows2, past2, filled2) = session.calls
    assert (rows, past, filled) == (4, 0, None)  # the first call: the new context and a masked block
    assert (rows2, past2) == (0, 4) and filled2 == [1] * (session.blocks[-1] - 1)  # then its drafts in the block
    assert draft.tokens == [2, 2, 2]  # drafted from the second call


@pytest.mark.parametrize("which", ["qwen3", "qwen3_copy"])
def test_runtime_loop_matches_the_torch_reference_loop(which, request):
    """Same drafts, same acceptance, step by step, with a full block verified each step (a
    copy-aware drafter given lookup's copies by both)."""
    import dflash.runtime.speculative as speculative
    from dflash.export.dflash import DFlashDrafter, reference_generate
    from transformers import AutoModelForCausalLM

    bundle, hf, drafter_folder = request.getfixturevalue(f"{which}_dflash")
    target = AutoModelForCausalLM.from_pretrained(hf).eval()
    drafter = DFlashDrafter.load(drafter_folder)
    model = Model(bundle)
    accepted, original = [], speculative.accept

    def spy(draft, logits, pick):
        rows, new = original(draft, logits, pick)
        accepted.append(len(rows) - 1)
        return rows, new

    for ids in ([5 + i % 7 for i in range(30)], list(range(4, 90, 5))):
        tokens, ref_accepted = reference_generate(target, drafter, ids, 40)
        accepted.clear()
        speculative.accept = spy
        try:
            result = model.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True, drafter="dflash",
                                    draft_len=BLOCK - 1)
        finally:
            speculative.accept = original
        assert result.tokens == tokens
        assert accepted == ref_accepted


def prompts():
    return [[5 + i % 9 for i in range(40)], list(range(4, 70, 3)), [7, 30, 3, 90, 41]]


@pytest.mark.parametrize("which", ["qwen3", "qwen3_copy", "qwen3_int8kv"])
def test_greedy_is_lossless(which, request):
    model = Model(request.getfixturevalue(f"{which}_dflash")[0])
    assert {"dflash", "dflash-tree", "dflash-hybrid"} <= set(model.drafters)
    for ids in prompts():
        plain = model.generate(input_ids=ids, max_new_tokens=60, ignore_eos=True)
        for drafter in ("dflash", "dflash-tree", "dflash-hybrid"):
            for draft_len in (None, 1, 6, BLOCK - 1):
                spec = model.generate(input_ids=ids, max_new_tokens=60, ignore_eos=True, drafter=drafter,
                                      draft_len=draft_len)
                assert spec.tokens == plain.tokens, (drafter, draft_len)


def test_greedy_is_lossless_on_the_default_target(default_dflash):
    model = Model(default_dflash[0])
    ids = model.encode(messages=[{"role": "user", "content": "Name three colours."}])
    plain = model.generate(input_ids=ids, max_new_tokens=24)
    for drafter in ("dflash", "dflash-tree"):
        assert model.generate(input_ids=ids, max_new_tokens=24, drafter=drafter, draft_len=4).tokens == plain.tokens


def test_sampling_is_seed_for_seed_identical(qwen3_dflash):
    model = Model(qwen3_dflash[0])
    for seed in range(10):
        options = dict(input_ids=prompts()[2], max_new_tokens=12, temperature=0.8, top_p=0.9, seed=seed,
                       ignore_eos=True)
        plain = model.generate(**options)
        for drafter in ("dflash", "dflash-tree", "dflash-hybrid"):
            assert model.generate(drafter=drafter, draft_len=4, **options).tokens == plain.tokens


def test_sampling_distribution_matches_plain_sampling(qwen3_dflash):
    """As in test_speculative: independent seeds, chi-square at alpha 0.001, tokens 2 and 3."""
    model = Model(qwen3_dflash[0])
    options = dict(input_ids=prompts()[2], max_new_tokens=3, temperature=1.0, ignore_eos=True)
    n = 3000
    plain = [model.generate(seed=s, **options).tokens for s in range(n)]
    spec = [model.generate(seed=n + s, drafter="dflash-tree", draft_len=4, **options).tokens for s in range(n)]
    for position in (1, 2):
        a = collections.Counter(t[position] for t in plain)
        b = collections.Counter(t[position] for t in spec)
        stat, critical = chi_square_p_below(a, b, 0.001)
        assert stat < critical, (position, stat, critical)


def zlab_folder(tmp_path, **overrides):
    from tiny_models import save_dflash_folder

    options = dict(hidden_size=64, target_layers=8, taps=[1, 2, 3, 4, 5], vocab_size=259, mask_token_id=3,
                   block_size=BLOCK)
    options.update(overrides)
    return save_dflash_folder(tmp_path / "drafter", **options)


@pytest.mark.parametrize("overrides, message", [
    ({"taps": [1, 2, 3, 4, 9]}, r"target_layer_ids \[1, 2, 3, 4, 9\] exceed the target's 8 layers"),
    ({"mask_token_id": 300}, "mask_token_id 300 lies outside the target's embedding"),
    ({"taps": [1, 3, 6]}, r"re-export the target with `--taps 1,2,3,4,5,6`"),
    ({"hidden_size": 32}, "hidden size 32 differs from the target's 64"),
])
def test_drafter_for_another_target_is_refused(qwen3_dflash, tmp_path, overrides, message):
    from dflash.export.cli import export_dflash
    from dflash.export.sources import SourceError

    folder = zlab_folder(tmp_path, **overrides)
    with pytest.raises(SourceError, match=message):
        export_dflash(folder, qwen3_dflash[0])


def test_not_a_dflash_checkpoint_is_refused(tmp_path):
    from dflash.export.dflash import DFlashDrafter
    from dflash.export.sources import SourceError

    folder = zlab_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["DFlash2DraftModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SourceError, match="not a DFlash drafter"):
        DFlashDrafter.load(folder)
    with pytest.raises(SourceError, match="no config.json"):
        DFlashDrafter.load(tmp_path)


def test_draft_vocab_restricts_the_drafter_and_stays_lossless(qwen3_dflash, tmp_path):
    """`--draft-vocab N`: the graph scores N tokens (the text's most frequent and the specials),
    proposes only those, and decoding is still the target's own."""
    from tokenizers import Tokenizer

    from dflash.export.cli import export_dflash
    from dflash.export.draft_vocab import frequent_tokens
    from dflash.export.sources import SourceError

    bundle = tmp_path / "bundle"
    shutil.copytree(qwen3_dflash[0], bundle)
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat and the dog sat on the log " * 20)
    with pytest.raises(SourceError, match="--draft-vocab 100000 must lie in"):
        export_dflash(qwen3_dflash[2], bundle, draft_vocab=100000, vocab_text=[text])
    manifest = export_dflash(qwen3_dflash[2], bundle, draft_vocab=40, vocab_text=[text])
    assert manifest["dflash"]["draft_vocab"] == 40
    assert manifest["dflash"]["export_check"]["logits"] <= 1e-4

    tokenizer = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    kept = set(frequent_tokens(bundle / "tokenizer.json", 40, [text.read_text()]).tolist())
    assert set(tokenizer.encode("the cat sat on the mat").ids) | set(tokenizer.get_added_tokens_decoder()) <= kept
    model = Model(bundle)
    session = DrafterSession(model.bundle)
    assert session.logits.shape[-1] == 40
    context = np.random.default_rng(0).standard_normal((3, session.width)).astype(np.float32)
    _, ids = session.run(context, anchor=5, past=0)
    assert set(ids.ravel().tolist()) <= kept  # proposals are target ids from the kept set
    for ids in prompts():
        plain = model.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True)
        assert model.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True, drafter="dflash-tree").tokens \
            == plain.tokens


def test_eval_reports_tau_per_position_and_per_kind(qwen3_dflash, tmp_path):
    """`dflash-train eval`: a full block verified each step; tau overall, per position, per kind."""
    from click.testing import CliRunner

    from dflash.train.cli import main
    from dflash.train.evaluate import add_counts as _add_counts, tau as _tau

    assert _add_counts([3, 1], [1, 0, 2]) == [4, 1, 2] and _tau([4, 1, 2]) == 1 + (1 + 4) / 7
    prompts = tmp_path / "prompts.jsonl"
    rows = [("chat", "hello there"), ("code", "def f(x):"), ("chat", "one two three")]
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "kind": kind, "prompt": text})
                                 for i, (kind, text) in enumerate(rows)))
    result = CliRunner().invoke(main, ["eval", "--bundle", str(qwen3_dflash[0]), "--prompts", str(prompts),
                                       "--max-new-tokens", "12"])
    assert result.exit_code == 0, result.output
    assert f"(block {BLOCK})" in result.output and "position 1: accepted" in result.output
    kinds = result.output.split("tau by prompt kind: ")[1]
    assert kinds.startswith("chat ") and ", code " in kinds
    # --shard: a data round's one-turn requests, by source (a follow-up has no messages of its own)
    from dflash.train import shards

    shard = tmp_path / "shard-00000.npz"
    shards.write(shard, [{"id": f"r00000-0{i}", "kind": kind, "source": source, "answer": [5, 6], "greedy": [5, 6],
                          "ended": True, **({"messages": [{"role": "user", "content": text}]} if text else
                                            {"parent": "r00000-00", "followup": "Why?"})}
                         for i, (source, kind, text) in enumerate([("magpie", "chat", "hello there"),
                                                                   ("template", "code", "def f(x):"),
                                                                   ("followup", "chat", None)])])
    result = CliRunner().invoke(main, ["eval", "--bundle", str(qwen3_dflash[0]), "--shard", str(shard),
                                       "--max-new-tokens", "8"])
    assert result.exit_code == 0, result.output
    assert result.output.split("tau by prompt kind: ")[1].split(", ")[0].startswith("magpie-chat ")
    assert "template-code " in result.output and "followup" not in result.output


def test_a_drafter_reading_some_of_the_taps_matches_the_reference(qwen3_dflash, tmp_path):
    """A bundle may carry more taps than a drafter reads (DFlash and EAGLE-3 taps at once): the
    runtime hands the drafter its own layers' columns, in its order."""
    import shutil

    from dflash.export.cli import export_dflash
    from dflash.export.dflash import DFlashDrafter, reference_generate
    from tiny_models import save_dflash_folder
    from transformers import AutoModelForCausalLM

    bundle, hf, _ = qwen3_dflash
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    config = json.loads((hf / "config.json").read_text())
    folder = save_dflash_folder(tmp_path / "drafter", config["hidden_size"], 8, [2, 4], config["vocab_size"],
                                mask_token_id=3, block_size=BLOCK, seed=4)
    export_dflash(folder, copy)
    target = AutoModelForCausalLM.from_pretrained(hf).eval()
    ids = list(range(4, 90, 5))
    tokens, _ = reference_generate(target, DFlashDrafter.load(folder), ids, 30)
    result = Model(copy).generate(input_ids=ids, max_new_tokens=30, ignore_eos=True, drafter="dflash",
                                  draft_len=BLOCK - 1)
    assert result.tokens == tokens


def test_an_int4_drafter_runs_on_matmul_q4_and_stays_lossless(qwen3_dflash, tmp_path):
    """`dflash-export drafter --dtype int4` (the CLI's default) runs the drafter's MatMuls on
    MatMulQ4 when the bundle loads the op library; the output is still the target's own."""
    import onnx

    from dflash.export.cli import export_dflash

    bundle = tmp_path / "bundle"
    shutil.copytree(qwen3_dflash[0], bundle)
    manifest = export_dflash(qwen3_dflash[2], bundle, "int4")
    assert manifest["graphs"]["drafter"] == {"file": "drafter_int4.onnx", "dtype": "int4", "matmul": "q4"}
    assert not (bundle / "drafter.onnx").exists()
    ops = {n.op_type for n in onnx.load(bundle / "drafter_int4.onnx", load_external_data=False).graph.node}
    assert "MatMulQ4" in ops
    model = Model(bundle)
    for ids in prompts():
        plain = model.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True).tokens
        for drafter in ("dflash", "dflash-tree"):
            assert model.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True, drafter=drafter).tokens == plain


def test_ship_stores_int8_matrices_that_load_within_a_step_and_stay_lossless(qwen3_dflash, tmp_path):
    """`dflash-train ship`: a drafter as the package ships it, int8 matrices with a scale per row;
    it loads within about half a quantization step of the original and decodes the target's tokens."""
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from dflash.export.cli import export_dflash
    from dflash.export.dflash import DFlashDrafter
    from dflash.train.cli import main

    result = CliRunner().invoke(main, ["ship", str(qwen3_dflash[2]), "--out", str(tmp_path / "shipped")])
    assert result.exit_code == 0, result.output
    stored = load_file(str(tmp_path / "shipped" / "model.safetensors"))
    weight = "layers.0.mlp.down_proj.weight"
    assert stored[weight].dtype == torch.int8 and stored[weight + "_scale"].dtype == torch.float16
    original, shipped = (DFlashDrafter.load(f).state_dict() for f in (qwen3_dflash[2], tmp_path / "shipped"))
    assert original.keys() == shipped.keys()
    for name, w in original.items():
        step = w.abs().amax(dim=1, keepdim=True) / 127 if w.dim() == 2 else w.abs().max() / 100
        assert ((w - shipped[name]).abs() <= step * 0.6 + 1e-6).all(), name  # half a step, plus the fp16 scale's rounding
    bundle = tmp_path / "bundle"
    shutil.copytree(qwen3_dflash[0], bundle)
    export_dflash(tmp_path / "shipped", bundle)
    model = Model(bundle)
    for ids in prompts():
        plain = model.generate(input_ids=ids, max_new_tokens=30, ignore_eos=True)
        assert model.generate(input_ids=ids, max_new_tokens=30, ignore_eos=True, drafter="dflash").tokens \
            == plain.tokens
    refused = CliRunner().invoke(main, ["ship", str(tmp_path), "--out", str(tmp_path / "x")])
    assert refused.exit_code != 0 and "has no config.json" in refused.output and "Traceback" not in refused.output


def test_the_shipped_drafter_is_stored_compactly_and_fits_the_default_model(default_bundle):
    """export/default_drafter: int8 matrices (dflash-train ship), a draft vocabulary, and the
    shape the default model's bundle takes (its taps and width), so `drafter default` exports."""
    from safetensors import safe_open

    from dflash.export.cli import DEFAULT_DRAFTER
    from dflash.export.dflash import DFlashDrafter

    with safe_open(str(DEFAULT_DRAFTER / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.int8
    drafter = DFlashDrafter.load(DEFAULT_DRAFTER)
    manifest = json.loads((default_bundle / "dflash.json").read_text())
    assert set(drafter.config.target_layer_ids) <= set(manifest["taps"])
    assert drafter.config.hidden_size == manifest["hidden_size"] and drafter.d2t is not None
