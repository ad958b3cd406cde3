"""dflash-train: the objective's pieces, the prompt sources, the sampler, and the whole pipeline
(data -> resume -> fit -> resume -> export -> lossless decoding) on a tiny target, in seconds."""

import random
import types

import numpy as np
import pytest
import torch


def test_block_mask_matches_a_brute_force_construction():
    from dflash.train.objective import block_mask

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


def test_anchors_and_label_rows_stay_inside_the_sequence():
    from dflash.train.objective import label_rows, sample_anchors

    assert sample_anchors(12, 20, 50, random.Random(0)) == list(range(11, 19))
    # position k of anchor a learns the target's forward row a+k-1 (which predicts token a+k)
    assert label_rows([17, 18], 4, 20).tolist() == [[17, 18, -1], [18, -1, -1]]


def test_greedy_path_keeps_a_position_only_while_the_data_before_it_is_the_argmax_and_draftable():
    from dflash.train.fit import greedy_path, target_to_draft
    from dflash.train.objective import label_rows

    rng = random.Random(1)
    d2t = torch.tensor([3, 5, 8, 13])  # draft id -> target id; 21 lies outside the draft vocabulary
    tokens = torch.tensor([rng.choice([3, 5, 8, 13, 21]) for _ in range(40)])
    # each row's argmax (target ids): mostly the data's next token, as along a greedy answer
    argmax = torch.tensor([int(t) if rng.random() < 0.8 else rng.choice([3, 5, 8, 13, 21])
                           for t in [*tokens[1:], 3]])
    anchors, block = [0, 4, 11, 26, 33], 6
    rows = label_rows(anchors, block, len(tokens))
    keep = greedy_path(argmax, tokens, rows, target_to_draft(d2t))
    for n, a in enumerate(anchors):
        for k in range(1, block):  # position k predicts token a+k; tokens a+1..a+k-1 come before it
            if rows[n, k - 1] < 0:
                continue  # past the end: no label at all
            expected = all(int(tokens[a + j]) == int(argmax[a + j - 1]) and int(tokens[a + j]) != 21
                           for j in range(1, k))
            assert bool(keep[n, k - 1]) == expected, (a, k)
    assert keep[:, 0].all() and not keep.all()
    # without a draft vocabulary every token is draftable
    whole = greedy_path(argmax, tokens, rows)
    assert (whole >= keep).all() and not torch.equal(whole, keep)


def test_int4_share_sets_the_fraction_of_steps_on_the_int4_answers():
    import random

    from dflash.train.fit import draw_row

    pools, rng = [[0, 1, 2], [10, 11]], random.Random(0)
    assert all(draw_row(pools, 1.0, rng) >= 10 for _ in range(50))
    assert all(draw_row(pools, 0.0, rng) < 10 for _ in range(50))
    share = sum(draw_row(pools, 0.3, rng) >= 10 for _ in range(4000)) / 4000
    assert 0.27 < share < 0.33
    assert {draw_row([[0, 1, 2]], None, rng) for _ in range(50)} == {0, 1, 2}  # one pool: no share


def test_a_paused_step_counts_only_up_to_the_cap_against_the_budget():
    import time

    from dflash.train.fit import MAX_STEP_SECONDS, step_seconds

    assert step_seconds(time.perf_counter() - 600) == MAX_STEP_SECONDS  # stopped for ten minutes
    assert 0.2 <= step_seconds(time.perf_counter() - 0.25) < 1.0  # an ordinary step counts as it ran


def test_soft_loss_is_cross_entropy_for_one_hot_labels_and_ignores_outside_ids():
    from dflash.train.objective import position_weights, soft_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 10)
    hard = torch.tensor([[1, 4, 7], [0, 2, 9]])
    ids = torch.stack([hard, torch.full_like(hard, -1)], -1)  # second label outside the draft vocabulary
    probs = torch.tensor([0.6, 0.4]).expand(2, 3, 2)
    valid = torch.ones(2, 3)
    w = position_weights(4)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 10), hard.reshape(-1), reduction="none")
    expected = (expected.view(2, 3) * w).sum() / (2 * w.sum())
    assert torch.allclose(soft_loss(logits, ids, probs, valid, w), expected, atol=1e-6)


def test_loss_over_labelled_rows_only_equals_the_whole_blocks_loss():
    from dflash.export.dflash import DFlashConfig, DFlashDrafter
    from dflash.train.fit import _zlab_config
    from dflash.train.objective import block_logits, labelled_rows, position_weights, soft_loss

    torch.manual_seed(0)
    tc = types.SimpleNamespace(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                               rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64, vocab_size=100,
                               num_hidden_layers=4, hidden_act="silu", head_dim=8)
    drafter = DFlashDrafter(DFlashConfig.from_dict(_zlab_config(tc, {"taps": [1, 2]}, 1, 4, 0)))
    c = drafter.config
    features, tokens = torch.randn(12, 2 * 32), torch.randint(0, 100, (12,))
    embed, lm_head = torch.randn(100, 32), torch.randn(32, 20)
    cos, sin = c.rotary_tables(32)
    ids = torch.randint(-1, 20, (3, 3, 2))
    ids[0, 1] = -1  # all of its label outside the draft vocabulary
    probs, valid, w = torch.rand(3, 3, 2), torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 1, 1]]), position_weights(4)

    def loss_and_grads(rows):
        drafter.zero_grad()
        logits = block_logits(drafter, features, tokens, [1, 4, 8], embed, lm_head, cos, sin, rows=rows)
        if rows is None:
            loss = soft_loss(logits, ids, probs, valid, w)
        else:
            loss = soft_loss(logits, ids[rows], probs[rows], valid[rows], w.expand_as(valid)[rows])
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in drafter.parameters()]

    keep = labelled_rows(valid, ids)
    assert keep.sum() == 5
    (whole, whole_grads), (kept, kept_grads) = loss_and_grads(None), loss_and_grads(keep)
    assert torch.allclose(whole, kept, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(whole_grads, kept_grads))


def test_self_written_requests_are_filtered_and_deduplicated():
    from dflash.train.prompts import acceptable_request, dedup_key

    assert acceptable_request("How do I keep my sourdough starter alive over a long holiday?")
    assert not acceptable_request("hi")  # too short
    assert not acceptable_request("the the the the the the the the the the the the")  # a loop
    assert not acceptable_request("Write a poem.\nWrite a poem.\nWrite a poem about it")  # repeated lines
    assert dedup_key("What is X, exactly? And why?") == dedup_key("what is x exactly and why")


def test_sampler_greedy_matches_generate_and_rows_do_not_disturb_each_other(tmp_path):
    from tiny_models import make_model, make_tokenizer

    from dflash.train.sampler import sample

    tok = make_tokenizer()
    model = make_model("llama", len(tok))
    prompts = [tok("the quick brown fox").input_ids, tok("a cache holds keys").input_ids[:3]]
    together = sample(model, prompts, 12, {2}, 0, temperature=0)
    alone = [sample(model, [p], 12, {2}, 0, temperature=0)[0] for p in prompts]
    assert [s.tokens for s in together] == [s.tokens for s in alone]
    for p, s in zip(prompts, together):
        assert s.tokens == s.greedy  # at temperature 0 the sample is the argmax label
        ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=2)[0, len(p):]
        assert s.tokens == ref.tolist()[: len(s.tokens)]
    sampled = sample(model, prompts * 3, 12, {2}, 0, temperature=1.0, seed=3)
    assert sampled[0].tokens != sampled[2].tokens or sampled[1].tokens != sampled[3].tokens


class _ScriptedTarget:
    """Stands in for data.Target: characters are tokens, and every answer is the same note."""
    user_opening = "<user>"
    note = "Hi all, the team meeting moves to Friday at three. Please bring your notes and one idea for the spring plan."

    def render(self, messages):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def sample(self, prompts, max_new_tokens, temperature, top_p, seed):
        from dflash.train.sampler import Sampled

        return [Sampled(self.encode(f"{self.note} ({seed} {i})"), [], True) for i in range(len(prompts))]


def test_recipe_2_rewrites_the_targets_own_passages_and_goes_three_turns_deep():
    from dflash.train import varied
    from dflash.train.data import MIX_VARIED, plan_round

    target, rounds = _ScriptedTarget(), []
    for rnd in range(6):
        rows = plan_round(target, rnd, 4, set(), rounds[-1] if rounds else [], prefix="v2q4o", recipe=2)
        assert rows == plan_round(target, rnd, 4, set(), rounds[-1] if rounds else [], prefix="v2q4o", recipe=2)
        for row in rows:
            row["answer"] = list(range(40))
        rounds.append(rows)
    first = rounds[0]
    rewrites = [r for r in first if r["source"] == "passage"]
    assert len(rewrites) == MIX_VARIED["passage"]
    for row in rewrites:
        instruction, passage = row["messages"][0]["content"].split("\n\n", 1)
        assert instruction in varied.REWRITES and len(passage.split()) == len(target.note.split()) + 2
    templates = {r["messages"][0]["content"] for r in first if r["source"] == "template"}
    assert len(templates) > 10 and {r["kind"] for r in first if r["source"] == "template"} <= {"chat", "code", "math", "list"}
    turns = [[r.get("turns") for r in rows if r["source"] == "followup"] for rows in rounds]
    assert turns[0] == [] and set(turns[1]) == {2}
    assert {t for later in turns[2:] for t in later} == {2, 3}  # a third user turn is the deepest
    text = "the quick brown fox jumps over the lazy sleeping dog"
    typo = varied.with_typos(text, random.Random(1), rate=1.0)
    assert typo != text and sorted(typo) == sorted(text)  # letters swapped, none lost


@pytest.fixture
def small_rounds(monkeypatch):
    from dflash.train import data

    monkeypatch.setattr(data, "MIX", {"magpie": 3, "followup": 2, "grounded": 2, "define": 1})
    monkeypatch.setattr(data, "BATCH", 10)
    monkeypatch.setattr(data, "MAGPIE_CANDIDATES", 6)


def test_data_answers_a_prompt_file_round_by_round_until_it_is_used_up(tmp_path, monkeypatch):
    import json

    from tiny_models import save_model_folder

    from dflash.export import sources
    from dflash.train import data, shards
    from dflash.train.data import Target, read_requests, run

    monkeypatch.setattr(data, "BATCH", 2)
    chat = [{"role": "user", "content": "Name a river."}, {"role": "assistant", "content": "The Nile."},
            {"role": "user", "content": "And a longer one?"}]
    lines = [{"prompt": "Say hello."}, {"messages": chat, "kind": "followup"}, {"prompt": "Count to five."}]
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    requests = read_requests(path)
    assert [r["kind"] for r in requests] == ["chat", "followup", "chat"] and requests[1]["messages"] == chat
    target = Target(sources.load(str(save_model_folder("qwen3", tmp_path / "hf", layers=2))))
    said = []
    run(target, tmp_path / "data", answer_tokens=10**6, max_new_tokens=8, echo=said.append, prefix="pr",
        requests=requests)
    rows = shards.read_all(tmp_path / "data")
    assert len(list((tmp_path / "data").glob("shard-*.npz"))) == 2 and "used up" in said[-1]
    assert [r["messages"] for r in rows] == [r["messages"] for r in requests]
    assert {r["source"] for r in rows} == {"file"} and all(r["id"].startswith("pr") for r in rows)
    assert all(r["answer"] and len(r["greedy"]) == len(r["answer"]) for r in rows)
    run(target, tmp_path / "data", answer_tokens=10**6, max_new_tokens=8, echo=said.append, prefix="pr",
        requests=requests)  # resumed: nothing left to answer
    assert len(shards.read_all(tmp_path / "data")) == 3
    from dflash.train.fit import load_sequences

    assert [r["prompt"] for r in load_sequences([tmp_path / "data"], target)] == [
        target.encode(target.render(r["messages"])) for r in requests]  # what a fit trains on
    for bad, problem in [("not json", "is not JSON"), ('{"text": "hi"}', "a user turn last"),
                         ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}',
                          "a user turn last"), ("", "holds no requests")]:
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match=problem) as error:
            read_requests(path)
        assert bad == "" or "line 1" in str(error.value)


def test_data_fit_resume_export_and_decode(tmp_path, small_rounds):
    from tiny_models import save_model_folder

    from dflash.export import sources
    from dflash.export.cli import export_dflash, export_target
    from dflash.runtime import Model
    from dflash.train import shards
    from dflash.train.data import Target, run
    from dflash.train.fit import load_sequences, train

    hf = save_model_folder("qwen3", tmp_path / "hf", layers=8)
    export_target(str(hf), tmp_path / "bundle", max_len=256)
    source = sources.load(str(hf))
    target = Target(source)
    run(target, tmp_path / "data", answer_tokens=1, max_new_tokens=16, echo=lambda m: None)
    assert len(list((tmp_path / "data").glob("shard-*.npz"))) == 1
    run(target, tmp_path / "data", answer_tokens=200, max_new_tokens=16, echo=lambda m: None)  # resumes
    rows = shards.read_all(tmp_path / "data")
    assert sum(len(r["answer"]) for r in rows) >= 200 and len({r["id"] for r in rows}) == len(rows)
    assert {"template", "followup"} <= {r["source"] for r in rows}
    followup = next(r for r in rows if r["source"] == "followup")
    conversation = shards.messages(followup, {r["id"]: r for r in rows}, target.decode)
    assert [m["role"] for m in conversation[-3:]] == ["user", "assistant", "user"]
    assert all(len(r["greedy"]) == len(r["answer"]) for r in rows)
    with pytest.raises(ValueError, match="resume it with the --id-prefix"):  # rows of another job's ids
        run(target, tmp_path / "data", answer_tokens=400, max_new_tokens=16, echo=lambda m: None, prefix="rb")
    # answers from the target computing as an int4 bundle does, in a folder fitted alongside
    from copy import deepcopy

    from dflash.train.int4_target import emulate_int4

    int4_source = deepcopy(source)
    emulate_int4(int4_source.model)
    run(Target(int4_source), tmp_path / "data4", answer_tokens=1, max_new_tokens=16, echo=lambda m: None,
        prefix="q4r")
    rows4 = shards.read_all(tmp_path / "data4")
    assert all(r["id"].startswith("q4r") for r in rows4)
    assert [r["answer"] for r in rows4] != [r["answer"] for r in rows[: len(rows4)]]
    both = load_sequences([tmp_path / "data", tmp_path / "data4"], target)
    assert len(both) == len(load_sequences([tmp_path / "data"], target)) + len(load_sequences([tmp_path / "data4"], target))
    with pytest.raises(ValueError, match="same id"):
        load_sequences([tmp_path / "data", tmp_path / "data"], target)
    # `fit --from-round 1`: the later rounds only; a follow-up's parent from round 0 still gives its prompt
    later_rounds = load_sequences([tmp_path / "data"], target, from_round=1)
    assert later_rounds and [r["id"] for r in later_rounds] == [
        r["id"] for r in load_sequences([tmp_path / "data"], target) if shards.round_of(r["id"]) >= 1]
    assert any(r["source"] == "followup" and r["id"].startswith("r00001") for r in later_rounds)
    # one first round per folder: the later rounds of one, all of the other
    mixed = load_sequences([tmp_path / "data", tmp_path / "data4"], target, from_round=[1, 0])
    assert [r["id"] for r in mixed] == [r["id"] for r in later_rounds] + [
        r["id"] for r in load_sequences([tmp_path / "data4"], target)]

    manifest = __import__("json").loads((tmp_path / "bundle" / "dflash.json").read_text())
    sequences = load_sequences([tmp_path / "data"], target)
    assert sequences[0]["prompt"] == target.encode(target.render(rows[0]["messages"]))
    options = dict(layers=1, block=8, draft_vocab=120, minutes=5, anchors=8, text_tokens=100, echo=lambda m: None)
    first = train(source, manifest, [tmp_path / "data"], tmp_path / "drafter", tmp_path / "cache", max_steps=20,
                  **options)
    assert first["step"] == 20 and first["history"]
    assert all(1 <= h[k] <= 8 for h in first["history"] for k in ("tau", "train_tau"))  # held-out and seen rows
    later = train(source, manifest, [tmp_path / "data"], tmp_path / "drafter", tmp_path / "cache", max_steps=30,
                  resume=True, greedy_only=True, **options)  # resumed under the greedy-path labels
    assert later["step"] == 30 and len(later["history"]) == len(first["history"]) + 1
    # labelled by the target computing as an int4 bundle does: its own cache, other features
    int4 = train(source, manifest, [tmp_path / "data"], tmp_path / "drafter4", tmp_path / "cache4", max_steps=2,
                 target_dtype="int4", **options)
    assert int4["step"] == 2
    fp32_features, int4_features = (np.load(tmp_path / c / "features.npy") for c in ("cache", "cache4"))
    assert fp32_features.shape == int4_features.shape and not np.array_equal(fp32_features, int4_features)
    # fp32-labelled rows and int4-written rows labelled by the int4 target, in one fit
    mixed = train(source, manifest, [tmp_path / "data"], tmp_path / "mixed", tmp_path / "cache", max_steps=3,
                  int4_data_dirs=[tmp_path / "data4"], **options)
    assert mixed["step"] == 3
    int4_answers = np.load(tmp_path / "cache" / "int4" / "features.npy")
    assert len(int4_answers) == sum(len(r["prompt"]) + len(r["answer"])
                                    for r in load_sequences([tmp_path / "data4"], target))
    with pytest.raises(ValueError, match="fp32 or int4"):
        train(source, manifest, [tmp_path / "data"], tmp_path / "drafter8", tmp_path / "cache8", max_steps=1,
              target_dtype="int8", **options)
    warm = train(source, manifest, [tmp_path / "data"], tmp_path / "warm", tmp_path / "cache", max_steps=0,
                 init_from=tmp_path / "drafter", **options)  # no step: saves the weights as loaded
    assert warm["step"] == 0
    from safetensors.torch import load_file
    saved, loaded = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("drafter", "warm"))
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    # warm-started on other data: the draft vocabulary is that data's (the drafter scores it with the
    # target's own lm_head rows); resumed, a fit keeps the vocabulary its checkpoint learned
    from dflash.export.dflash import DFlashDrafter
    from dflash.train.fit import draft_vocabulary

    warm4 = dict(options, text_tokens=0)
    train(source, manifest, [tmp_path / "data4"], tmp_path / "warm4", tmp_path / "cache", max_steps=1,
          init_from=tmp_path / "drafter", **warm4)
    vocabulary = DFlashDrafter.load(tmp_path / "warm4").d2t
    expected = draft_vocabulary(load_sequences([tmp_path / "data4"], target), options["draft_vocab"],
                                source.model.config.vocab_size)
    assert torch.equal(vocabulary, expected)
    train(source, manifest, [tmp_path / "data"], tmp_path / "warm4", tmp_path / "cache", max_steps=2, resume=True,
          **warm4)
    assert torch.equal(DFlashDrafter.load(tmp_path / "warm4").d2t, vocabulary)
    assert not torch.equal(vocabulary, draft_vocabulary(load_sequences([tmp_path / "data"], target),
                                                        options["draft_vocab"], source.model.config.vocab_size))
    # a deeper drafter grown from it: the new layer starts as the identity, so the same logits
    train(source, manifest, [tmp_path / "data"], tmp_path / "deeper", tmp_path / "cache", max_steps=0,
          init_from=tmp_path / "drafter", **{**options, "layers": 2})
    from dflash.train.objective import block_logits

    shallow, deep = (DFlashDrafter.load(tmp_path / d) for d in ("drafter", "deeper"))
    assert deep.config.layers == 2 and not deep.layers[1].mlp.down_proj.weight.any()
    c, generator = shallow.config, torch.Generator().manual_seed(0)
    features = torch.randn(12, len(c.target_layer_ids) * c.hidden_size, generator=generator)
    tokens, embed = torch.arange(12) % 100, torch.randn(c.vocab_size, c.hidden_size, generator=generator)
    lm_head = torch.randn(c.hidden_size, 120, generator=generator)
    cos, sin = c.rotary_tables(32)
    logits = [block_logits(d, features, tokens, [2, 5], embed, lm_head, cos, sin) for d in (shallow, deep)]
    assert torch.allclose(logits[0], logits[1], atol=1e-5)
    assert not torch.allclose(logits[0], block_logits(DFlashDrafter(deep.config), features, tokens, [2, 5], embed,
                                                     lm_head, cos, sin), atol=1e-3)  # the check can fail
    with pytest.raises(ValueError, match="another shape"):  # fewer layers than the source cannot be grown
        train(source, manifest, [tmp_path / "data"], tmp_path / "other", tmp_path / "cache", max_steps=1,
              init_from=tmp_path / "deeper", **options)
    # a wider MLP grown from it: the new units' outputs start at zero, so the same logits again
    train(source, manifest, [tmp_path / "data"], tmp_path / "wider", tmp_path / "cache", max_steps=0,
          init_from=tmp_path / "drafter", intermediate=2 * c.intermediate_size, **options)
    wide = DFlashDrafter.load(tmp_path / "wider")
    assert wide.config.intermediate_size == 2 * c.intermediate_size
    assert wide.layers[0].mlp.gate_proj.weight[c.intermediate_size:].any()  # new units read the input
    assert torch.allclose(logits[0], block_logits(wide, features, tokens, [2, 5], embed, lm_head, cos, sin),
                          atol=1e-5)
    with pytest.raises(ValueError, match="intermediate_size"):  # nor a narrower MLP
        train(source, manifest, [tmp_path / "data"], tmp_path / "other", tmp_path / "cache", max_steps=1,
              init_from=tmp_path / "wider", **options)

    from dflash.export.cli import export_eagle3
    from dflash.train import eagle3

    head = eagle3.train(source, manifest, [tmp_path / "data"], tmp_path / "head", tmp_path / "cache", draft_vocab=120,
                        minutes=5, max_steps=6, text_tokens=100, echo=lambda m: None)  # the same label cache
    assert head["step"] == 6 and head["history"]
    eagle3.train(source, manifest, [tmp_path / "data"], tmp_path / "head2", tmp_path / "cache", draft_vocab=120,
                 minutes=5, max_steps=0, text_tokens=100, init_from=tmp_path / "head", echo=lambda m: None)
    saved, loaded = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("head", "head2"))
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    export_dflash(tmp_path / "drafter", tmp_path / "bundle")
    export_eagle3(tmp_path / "head", tmp_path / "bundle")
    model = Model(tmp_path / "bundle")
    ids = list(range(4, 70, 3))
    plain = model.generate(input_ids=ids, max_new_tokens=30, ignore_eos=True)
    for drafter in ("dflash", "dflash-tree", "eagle3", "eagle3-tree"):
        assert model.generate(input_ids=ids, max_new_tokens=30, ignore_eos=True, drafter=drafter).tokens == plain.tokens
    # a drafter that refines its drafts in a second pass, through the runtime's two calls
    refined = train(source, manifest, [tmp_path / "data"], tmp_path / "refined", tmp_path / "cache", max_steps=2,
                    refine=True, init_from=tmp_path / "drafter", **options)
    assert refined["step"] == 2 and DFlashDrafter.load(tmp_path / "refined").config.refine
    export_dflash(tmp_path / "refined", tmp_path / "bundle")
    model = Model(tmp_path / "bundle")
    assert model.bundle.manifest["dflash"]["refine"]
    for drafter in ("dflash", "dflash-tree", "dflash-hybrid"):
        assert model.generate(input_ids=ids, max_new_tokens=30, ignore_eos=True, drafter=drafter).tokens == plain.tokens
    # a copy-aware drafter from the plain one: the same drafts until trained (its copy weights start at zero),
    # then its copy weights learn; exported, the runtime feeds it lookup's copies, and decoding stays lossless
    from dflash.train.objective import copy_candidates

    train(source, manifest, [tmp_path / "data"], tmp_path / "copy0", tmp_path / "cache", max_steps=0, copy=True,
          init_from=tmp_path / "drafter", **options)
    copy0 = DFlashDrafter.load(tmp_path / "copy0")
    assert copy0.config.copy and not copy0.copy_proj.weight.any() and not copy0.copy_kind.weight.any()
    repeating = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9])
    copy_ids = copy_candidates(repeating, [2, 6], 8)
    assert copy_ids[1].tolist() == [-1, 8, 5, 6, 7, -1, -1, -1] and copy_ids[0].tolist() == [-1] * 8
    logits = [block_logits(d, features, repeating, [2, 6], embed, lm_head, cos, sin) for d in (shallow, copy0)]
    assert torch.equal(logits[0], logits[1])
    train(source, manifest, [tmp_path / "data"], tmp_path / "copy", tmp_path / "cache", max_steps=3, copy=True,
          init_from=tmp_path / "drafter", **options)
    copied = DFlashDrafter.load(tmp_path / "copy")
    assert copied.copy_proj.weight.any() and copied.copy_kind.weight.any()
    with pytest.raises(ValueError, match="--copy"):  # a plain drafter cannot start from a copy-aware one
        train(source, manifest, [tmp_path / "data"], tmp_path / "other", tmp_path / "cache", max_steps=1,
              init_from=tmp_path / "copy", **options)
    export_dflash(tmp_path / "copy", tmp_path / "bundle")
    model = Model(tmp_path / "bundle")
    assert model.bundle.manifest["dflash"]["copy"]
    for drafter in ("dflash", "dflash-tree", "dflash-hybrid"):
        assert model.generate(input_ids=ids, max_new_tokens=30, ignore_eos=True, drafter=drafter).tokens == plain.tokens


def test_label_cache_resumes_where_it_stopped(tmp_path):
    from tiny_models import make_model, make_tokenizer

    from dflash.train.fit import LabelCache

    model = make_model("llama", len(make_tokenizer()), layers=4)
    rows = [{"id": f"r{i}", "prompt": [1, 5, 6], "answer": list(range(7, 7 + 5 + i))} for i in range(4)]
    whole = LabelCache(tmp_path / "a", rows, [1, 2], 64)
    whole.build(model, echo=lambda m: None)
    part = LabelCache(tmp_path / "b", rows[:2], [1, 2], 64)  # a run that stopped after two rows
    part.build(model, echo=lambda m: None)
    again = LabelCache(tmp_path / "b", rows, [1, 2], 64)
    assert again.done == 2
    again.build(model, echo=lambda m: None)
    for i in range(4):
        for a, b in zip(whole.sequence(i), again.sequence(i)):
            assert torch.equal(a, b)


def test_label_cache_stores_int8_features(tmp_path):
    """Features are int8 with a scale per token and tap (within 1% of the target's)."""
    from tiny_models import make_model, make_tokenizer

    from dflash.train.fit import LabelCache

    model = make_model("llama", len(make_tokenizer()), layers=4)
    rows = [{"id": f"r{i}", "prompt": [1, 5, 6], "answer": list(range(7, 17 + i))} for i in range(3)]
    cache = LabelCache(tmp_path, rows, [1, 2], 64)
    cache.build(model, echo=lambda m: None)
    assert np.load(tmp_path / "features.npy", mmap_mode="r").dtype == np.int8
    with torch.inference_mode():
        hidden = model(torch.tensor([rows[0]["prompt"] + rows[0]["answer"]]), output_hidden_states=True).hidden_states
    exact = torch.cat([hidden[2][0], hidden[3][0]], -1)
    stored = cache.sequence(0)[0]
    assert (stored - exact).norm() / exact.norm() < 0.01


def test_ort_engine_answers_with_the_bundles_own_graph(tiny, tmp_path, small_rounds):
    """`data --engine ort`: an int4 bundle's graph samples the answers, recording its argmax at
    every position; seeded rows repeat, and the rounds land in shards under the q4o prefix."""
    from click.testing import CliRunner

    from dflash.export import sources
    from dflash.train import shards
    from dflash.train.cli import main
    from dflash.train.data import Target, run
    from dflash.train.ort_sampler import OrtSampler

    bundle, hf = tiny("llama", max_len=2048 + 32, dtype="int4")  # room for the rounds' grounded prompts
    engine = OrtSampler(bundle, threads=1)
    target = Target(sources.load(str(hf)), engine)
    assert engine.dtype == "int4"
    prompt = target.encode("the quick brown fox")
    greedy = target.sample([prompt], 12, temperature=0, top_p=1.0, seed=0)[0]
    plain = engine.model.generate(input_ids=prompt, max_new_tokens=12, ignore_eos=True).tokens
    assert greedy.tokens == greedy.greedy == plain[: len(greedy.tokens)]
    first, again, other = (target.sample([prompt, prompt], 12, temperature=1.5, top_p=0.95, seed=seed)
                           for seed in (3, 3, 4))
    assert [s.tokens for s in first] == [s.tokens for s in again] != [s.tokens for s in other]
    assert first[0].tokens != first[1].tokens  # each row draws with its own seed
    run(target, tmp_path / "data", answer_tokens=1, max_new_tokens=16, echo=lambda m: None, prefix="q4o")
    rows = shards.read_all(tmp_path / "data")
    assert rows and all(r["id"].startswith("q4o") and len(r["greedy"]) == len(r["answer"]) for r in rows)
    result = CliRunner().invoke(main, ["data", "--target", str(bundle), "--out", str(tmp_path / "x"),
                                       "--engine", "ort", "--target-dtype", "int4"])
    assert result.exit_code != 0 and "drop --target-dtype" in result.output
    # --temperature 0: every answer is the target's greedy one; the folder resumes only at 0
    greedy_args = ["data", "--target", str(bundle), "--out", str(tmp_path / "greedy"), "--engine", "ort",
                   "--threads", "1", "--max-new-tokens", "16", "--tokens", "1"]
    result = CliRunner().invoke(main, greedy_args + ["--temperature", "0"])
    assert result.exit_code == 0, result.output
    rows = shards.read_all(tmp_path / "greedy")
    assert rows and all(r["answer"] == r["greedy"] and r["temperature"] == 0 for r in rows)
    result = CliRunner().invoke(main, greedy_args[:-1] + ["100000"])
    assert result.exit_code != 0 and "resume it with --temperature 0.0" in result.output


@pytest.mark.parametrize("dtype", ["fp32", "int4"])
def test_a_batch_of_answers_is_what_one_at_a_time_samples(tiny, dtype):
    """`data --engine ort --batch N`: the batched graph answers many prompts together, each as the
    one-at-a-time path answers it, token for token (its own cache and seed), whatever the batch,
    while answers end, free their slots for the next prompts, and the live slots move down."""
    from click.testing import CliRunner

    from dflash.runtime.bundle import BundleError
    from dflash.train.cli import main
    from dflash.train.ort_sampler import OrtSampler

    bundle, _ = tiny("llama", max_len=160, dtype=dtype, batched=True)
    rng = np.random.default_rng(0)
    lengths = [1, 5, 70, 12, 3, 64, 40, 140, 9, 2, 30]  # prefills of one and of several chunks; 140: cut short
    prompts = [rng.integers(3, 200, n).tolist() for n in lengths]
    end_ids = set(range(3, 256, 9))  # answers end at different lengths
    one = OrtSampler(bundle, threads=1).sample(prompts, 24, end_ids, temperature=1.0, seed=5)
    assert len({len(a.tokens) for a in one}) > 3 and any(a.ended for a in one) and not all(a.ended for a in one)
    assert len(one[7].tokens) <= 160 - 140 + 1  # the cache holds no more
    for batch in (2, 3, 16):
        together = OrtSampler(bundle, threads=2 if batch == 3 else 1, batch=batch)
        got = together.sample(prompts, 24, end_ids, temperature=1.0, seed=5)
        assert [(a.tokens, a.greedy, a.ended) for a in got] == [(a.tokens, a.greedy, a.ended) for a in one], batch
    with pytest.raises(ValueError, match="shorten the prompt"):
        together.sample([[5] * 200], 4, end_ids)
    with pytest.raises(BundleError, match="--batched"):
        OrtSampler(tiny("llama")[0], batch=4)
    result = CliRunner().invoke(main, ["data", "--target", str(bundle), "--out", "x", "--batch", "4"])
    assert result.exit_code != 0 and "--batch is for --engine ort" in result.output


def test_ort_labeller_gives_the_bundles_taps_and_logits(tiny, tmp_path):
    """`fit --int4-bundle`: the exported graph in ONNX Runtime labels the cache. On an fp32 bundle its
    features and labels are the transformers target's (to int8 and float rounding), past one 64-row chunk;
    a bundle of another model or precision is refused."""
    from click.testing import CliRunner

    from dflash.export import sources
    from dflash.runtime.bundle import load_bundle
    from dflash.train.cli import main
    from dflash.train.fit import LabelCache
    from dflash.train.ort_sampler import OrtLabeller

    bundle, hf = tiny("llama")
    taps = load_bundle(bundle).taps
    model = sources.load(str(hf)).model.eval()
    rows = [{"id": f"r{i}", "prompt": [1, 5, 6], "answer": list(range(7, 7 + 70 + 5 * i))} for i in range(2)]
    by_torch = LabelCache(tmp_path / "torch", rows, taps, model.config.hidden_size)
    by_torch.build(model, echo=lambda m: None)
    by_ort = LabelCache(tmp_path / "ort", rows, taps, model.config.hidden_size)
    by_ort.build(OrtLabeller(bundle, taps, model.config.vocab_size, threads=1), echo=lambda m: None)
    for i in range(2):
        (f1, ids1, p1), (f2, ids2, p2) = by_torch.sequence(i), by_ort.sequence(i)
        assert len(f1) > 64 and (f1 - f2).norm() / f1.norm() < 1e-2  # int8 storage: a rounding may flip
        assert (ids1[:, 0] == ids2[:, 0]).float().mean() > 0.95 and torch.allclose(p1, p2, atol=2e-3)
    with pytest.raises(ValueError, match="export both bundles from the same model"):
        OrtLabeller(bundle, [t + 1 for t in taps], model.config.vocab_size)
    result = CliRunner().invoke(main, ["fit", "--target", str(bundle), "--data", str(tmp_path), "--out",
                                       str(tmp_path / "x"), "--int4-data", str(tmp_path), "--int4-bundle", str(bundle)])
    assert result.exit_code != 0 and "is not an int4 bundle" in result.output


def test_label_cache_grows_when_data_is_appended(tmp_path):
    from tiny_models import make_model, make_tokenizer

    from dflash.train.fit import LabelCache

    model = make_model("llama", len(make_tokenizer()), layers=4)
    rows = [{"id": f"r{i}", "prompt": [1, 5, 6], "answer": list(range(7, 7 + 5 + i))} for i in range(5)]
    d2t = torch.arange(0, 200, 2)
    whole = LabelCache(tmp_path / "a", rows, [1, 2], 64, d2t)
    whole.build(model, echo=lambda m: None)
    first = LabelCache(tmp_path / "b", rows[:3], [1, 2], 64, d2t)
    first.build(model, echo=lambda m: None)
    # labels are kept over the whole vocabulary: another draft vocabulary reads the same cache
    every = LabelCache(tmp_path / "b", rows[:3], [1, 2], 64)
    other = torch.arange(1, 150, 3)
    reread = LabelCache(tmp_path / "b", rows[:3], [1, 2], 64, other)
    assert every.done == reread.done == 3
    for i in range(3):
        ids, mapped = every.sequence(i)[1], reread.sequence(i)[1]
        inside = torch.isin(ids, other)
        assert inside.any() and not inside.all()
        assert torch.equal(mapped[inside], torch.searchsorted(other, ids[inside])) and (mapped[~inside] == -1).all()
        assert torch.equal(reread.argmax(i), ids[:, 0])  # the argmax stays in target ids
    grown = LabelCache(tmp_path / "b", rows, [1, 2], 64, d2t)
    assert grown.done == 3  # the first three rows are kept, only the new ones are labelled
    grown.build(model, echo=lambda m: None)
    for i in range(5):
        for a, b in zip(whole.sequence(i), grown.sequence(i)):
            assert torch.equal(a, b)
    # More offline text ahead of the answers (a larger --text-tokens): the labelled sequences are
    # kept wherever they now sit, only the new ones are labelled; a row left out costs nothing.
    text = [{"id": f"text{i}", "prompt": [], "answer": list(range(30, 36 + i))} for i in range(2)]
    more = text + rows[1:]
    reference = LabelCache(tmp_path / "c", more, [1, 2], 64, d2t)
    reference.build(model, echo=lambda m: None)
    labelled = []
    moved = LabelCache(tmp_path / "b", more, [1, 2], 64, d2t)
    assert moved.done == 5
    moved.build(model, echo=labelled.append)
    assert len(labelled) == 1 and "7/7 sequences" in labelled[0]  # one progress line: the two new rows
    for i in range(len(more)):
        for a, b in zip(reference.sequence(i), moved.sequence(i)):
            assert torch.equal(a, b)
    changed = [dict(rows[0], answer=rows[0]["answer"] + [9])] + rows[1:]  # same id, other tokens
    assert LabelCache(tmp_path / "b", changed, [1, 2], 64, d2t).done == 0


def test_missing_data_is_a_clear_error(tmp_path):
    from click.testing import CliRunner

    from dflash.train.cli import main

    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(main, ["fit", "--target", str(tmp_path), "--data", str(tmp_path / "empty"),
                                       "--out", str(tmp_path / "out")])
    assert result.exit_code != 0 and "run `dflash-train data` first" in result.output
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shard-00000.npz").touch()
    result = CliRunner().invoke(main, ["fit", "--target", str(tmp_path), "--data", str(tmp_path / "data"),
                                       "--from-round", "1", "--from-round", "2", "--out", str(tmp_path / "out")])
    assert result.exit_code != 0 and "2 --from-round for 1 data folders: give one for all" in result.output


def test_suffix_corpus_drafts_the_majority_continuation_and_saves_steps():
    from dflash.runtime.suffix import SuffixIndex
    from dflash.train.copying import simulate

    corpus = SuffixIndex.from_answers([[1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 5, 7], [8, 2, 3, 4, 5, 6]])
    assert corpus.draft([0, 0, 2, 3]) == [4, 5, 6]  # 6 follows twice, 7 once
    assert corpus.draft([0, 0, 11]) == []
    answer = [2, 3, 4, 5, 6]
    assert simulate([0], answer, None) == 5  # nothing to copy: one token a step
    assert simulate([0], answer, corpus) < 5


def test_the_int4_emulating_target_computes_like_matmul_q4():
    """Each emulated Linear gives MatMulQ4's numbers (ops/reference.py, bit-exact to the op) up to
    float summation order, and the model's embedding table stays the fp32 one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash.ops.reference import matmul_q4, pack_q4
    from dflash.train.int4_target import emulate_int4

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    embed = model.get_input_embeddings().weight.detach().clone()
    linear = model.model.layers[0].mlp.down_proj  # 96 inputs
    w = linear.weight.detach().float().t().numpy()
    emulate_int4(model)
    a = np.random.default_rng(0).standard_normal((5, 96)).astype(np.float32)
    with torch.no_grad():
        got = linear(torch.from_numpy(a)).numpy()
    want = matmul_q4(a, *pack_q4(w), w.shape[1])
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert not np.allclose(got, a @ w, atol=1e-3)  # and it is not the fp32 product
    assert torch.equal(model.get_input_embeddings().weight, embed)
