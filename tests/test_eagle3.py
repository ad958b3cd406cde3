"""EAGLE-3 heads: both checkpoint layouts load, the tap conventions, and the ONNX drafter graph
against the torch reference."""

import numpy as np
import pytest
import torch

from tiny_models import save_eagle3_folder


def test_the_two_layouts_load_to_the_same_head(tmp_path):
    from dflash.export.eagle3 import Eagle3Head

    reference = Eagle3Head.load(save_eagle3_folder(tmp_path / "ref", 64, 160, "reference", draft_vocab=40), 8)
    speculators = Eagle3Head.load(save_eagle3_folder(tmp_path / "spec", 64, 160, "speculators", draft_vocab=40), 8)
    assert reference.config.layout == "reference" and speculators.config.layout == "speculators"
    assert (reference.config.head_dim, reference.config.kv_heads, reference.config.draft_vocab_size) == (16, 2, 40)
    for (name, a), (_, b) in zip(reference.state_dict().items(), speculators.state_dict().items()):
        assert torch.equal(a, b), name
    assert reference.target_ids(torch.tensor([0, 1, 39])).tolist() == [0, 2, 78]


@pytest.mark.parametrize("aux, taps", [(None, [1, 14, 26]), ([1, 14, 26], [1, 14, 26]), ([2, 15, 27], [1, 14, 26])])
def test_tap_conventions(aux, taps):
    """Ids starting at 1 are layer outputs; at 2 or later, layer inputs (vLLM's default 2, N//2, N-3)."""
    from dflash.export.eagle3 import tap_layers

    assert tap_layers(aux, 30) == taps


def test_a_folder_that_is_not_a_head_is_refused(tmp_path):
    from dflash.export.eagle3 import Eagle3Head
    from dflash.export.sources import SourceError
    from tiny_models import save_dflash_folder

    with pytest.raises(SourceError, match="not an EAGLE-3 head"):
        Eagle3Head.load(save_dflash_folder(tmp_path / "dflash", 64, 8, [1, 3], 160, 5), 8)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no config.json"):
        Eagle3Head.load(tmp_path / "empty", 8)


def test_graph_matches_the_reference_over_steps(tmp_path):
    """The graph (cache op, in-place rows) against the reference (plain growing cache): target rows,
    then the head's own rows, then a tree of two branches over the committed rows."""
    from dflash.export.eagle3 import DrafterGraph, Eagle3Head, Reference

    head = Eagle3Head.load(save_eagle3_folder(tmp_path / "h", 64, 160, draft_vocab=40), 8)
    c = head.config
    embed = torch.randn(160, 64, generator=torch.Generator().manual_seed(1))
    graph, reference = DrafterGraph(head, embed, 64).eval(), Reference(head, embed, 64)
    keys, values = torch.zeros(1, c.kv_heads, 64, c.head_dim), torch.zeros(1, c.kv_heads, 64, c.head_dim)
    g = torch.Generator().manual_seed(2)
    past = 0

    def run(n_target, states, tokens, mask=None):
        nonlocal past, keys, values
        r = len(tokens)
        features = torch.randn(n_target, 3 * 64, generator=g)
        mask = torch.tril(torch.ones(r, r, dtype=torch.bool)) if mask is None else mask
        depth = mask.sum(-1) - 1  # a tree row's position is its depth past the committed rows
        positions = (past + depth).tolist()
        want_logits, want_out = reference.step(features, states, tokens, positions, mask)
        with torch.no_grad():
            top_lp, top_ids, out, logits, keys, values = graph(
                features.unsqueeze(0), states.unsqueeze(0), torch.tensor([tokens]), torch.tensor([positions]),
                mask, torch.tensor(past), keys, values)
        assert torch.allclose(logits[0], want_logits, atol=1e-5) and torch.allclose(out[0], want_out, atol=1e-5)
        assert torch.equal(top_ids[0, :, 0], head.target_ids(want_logits.argmax(-1)))
        past += r
        return out[0]

    out = run(5, torch.zeros(0, 64), [3, 9, 4, 7, 1])
    out = run(0, out[-1:], [12])
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root, then two children
    run(0, torch.cat([out, out, out]), [5, 6, 8], tree)
    reference.keep(past - 3)  # the tree is dropped: the cache keeps committed rows only
    past -= 3
    run(2, torch.zeros(0, 64), [5, 6])


def test_onnx_graph_matches_torch(tmp_path):
    import onnxruntime as ort

    from dflash import ops
    from dflash.export.eagle3 import DrafterGraph, Eagle3Head, example_inputs, export_onnx

    head = Eagle3Head.load(save_eagle3_folder(tmp_path / "h", 64, 160, draft_vocab=40), 8)
    embed = torch.randn(160, 64)
    export_onnx(head, embed, 48, "custom", tmp_path / "eagle3.onnx")
    opts = ort.SessionOptions()
    ops.register(opts)
    session = ort.InferenceSession(str(tmp_path / "eagle3.onnx"), opts)
    graph = DrafterGraph(head, embed, 48).eval()
    for n, m in ((3, 0), (0, 2), (2, 3), (1, 0)):
        inputs = example_inputs(head.config, 48, n=n, m=m, past=4, seed=n + m)
        feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs)}
        got = session.run(None, feeds)
        with torch.no_grad():
            want = graph(*inputs)
        for name, a, b in zip(["top_logprobs", "top_ids", "hidden", "logits", "key", "value"], got, want):
            assert np.abs(a - b.numpy()).max() <= 1e-4, (name, n, m)


def target_vocab(hf) -> int:
    import json

    return json.loads((hf / "config.json").read_text())["vocab_size"]


def with_eagle3_head(tiny, tmp_path_factory, kv_dtype="fp32"):
    """A tiny target exported with the taps an EAGLE-3 head reads, and a random head added."""
    import shutil

    from dflash.export.cli import export_eagle3
    from tiny_models import save_eagle3_folder

    # the head reads three of them (not 3: the last layer)
    bundle, hf = tiny("llama", taps="0,1,2,3", kv_dtype=kv_dtype)
    folder = tmp_path_factory.mktemp("eagle3") / "bundle"
    shutil.copytree(bundle, folder)
    head = save_eagle3_folder(folder.parent / "head", 64, target_vocab(hf), "reference", aux_ids=[0, 1, 2], draft_vocab=60,
                              std=0.3)
    export_eagle3(head, folder)
    return folder


@pytest.fixture(scope="module")
def eagle3_bundle(tiny, tmp_path_factory):
    return with_eagle3_head(tiny, tmp_path_factory)


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16"])
def test_eagle3_modes_are_lossless(tiny, tmp_path_factory, eagle3_bundle, kv_dtype):
    from dflash.runtime import Model

    model = Model(eagle3_bundle if kv_dtype == "fp32" else with_eagle3_head(tiny, tmp_path_factory, kv_dtype))
    assert {"eagle3", "eagle3-tree", "eagle3-hybrid"} <= set(model.drafters)
    for ids in (list(range(4, 40, 3)), [5, 9, 9, 9, 12, 5, 9, 9]):
        plain = model.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True).tokens
        for drafter in ("eagle3", "eagle3-tree", "eagle3-hybrid"):
            for draft_len in (None, 3):
                got = model.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True, drafter=drafter,
                                     draft_len=draft_len)
                assert got.tokens == plain, (drafter, draft_len)


def test_eagle3_sampling_repeats_with_a_seed(eagle3_bundle):
    from dflash.runtime import Model

    model = Model(eagle3_bundle)
    ids = list(range(4, 30, 2))
    plain = model.generate(input_ids=ids, max_new_tokens=30, ignore_eos=True, temperature=0.8, seed=3).tokens
    for drafter in ("eagle3", "eagle3-tree", "eagle3-hybrid"):
        got = model.generate(input_ids=ids, max_new_tokens=30, ignore_eos=True, temperature=0.8, seed=3,
                             drafter=drafter, draft_len=3).tokens
        assert got == plain, drafter


def test_a_head_for_other_taps_names_the_re_export(tiny, tmp_path):
    import shutil

    from dflash.export.cli import export_eagle3
    from dflash.export.sources import SourceError
    from tiny_models import save_eagle3_folder

    bundle, hf = tiny("llama")  # taps [1] only
    folder = tmp_path / "bundle"
    shutil.copytree(bundle, folder)
    head = save_eagle3_folder(tmp_path / "head", 64, target_vocab(hf), aux_ids=[0, 1, 2])
    with pytest.raises(SourceError, match="--taps 0,1,2"):
        export_eagle3(head, folder)
    wide = save_eagle3_folder(tmp_path / "wide", 32, target_vocab(hf), aux_ids=[0, 1, 2])
    with pytest.raises(SourceError, match="another target"):
        export_eagle3(wide, folder)


def test_drafts_follow_the_torch_reference(eagle3_bundle):
    """The runtime's chain drafts equal a torch loop over the head (target features of the
    committed positions paired with the next token, then the head's own states): the pairing
    and positions are right, not just harmless."""
    import json

    from dflash.export.eagle3 import Eagle3Head, Reference
    from dflash.export.sources import load
    from dflash.runtime import Model

    manifest = json.loads((eagle3_bundle / "dflash.json").read_text())
    target = load(manifest["source"]).model
    head = Eagle3Head.load(manifest["eagle3"]["source"], target.config.num_hidden_layers)
    model = Model(eagle3_bundle)
    drafter = model.drafter("eagle3", 3)
    seen = []
    propose = drafter.propose

    def record(history, room):
        draft = propose(history, room)
        seen.append((list(history), list(draft.tokens)))
        return draft

    drafter.propose = record
    model.generate(input_ids=list(range(4, 40, 3)), max_new_tokens=12, ignore_eos=True, drafter="eagle3", draft_len=3)
    for history, drafts in seen[:3]:
        with torch.no_grad():
            out = target(torch.tensor([history[:-1]]), output_hidden_states=True)
        features = torch.cat([out.hidden_states[t + 1][0] for t in head.config.taps], dim=-1)
        reference = Reference(head, target.get_input_embeddings().weight.float(), 128)
        n = len(history) - 1
        logits, states = reference.step(features, torch.zeros(0, 64), history[1:], list(range(n)))
        want = []
        for depth in range(len(drafts)):
            token = int(head.target_ids(logits[-1].argmax()))
            want.append(token)
            logits, states = reference.step(torch.zeros(0, 3 * 64), states[-1:], [token], [n + depth])
        assert drafts == want


def test_eagle3_to_a_full_cache(eagle3_bundle):
    """Drafts never overrun the room left in the target's cache or the head's."""
    from dflash.runtime import Model

    model = Model(eagle3_bundle)
    ids = list(range(4, 40, 3))
    plain = model.generate(input_ids=ids, max_new_tokens=500, ignore_eos=True)
    for drafter in ("eagle3", "eagle3-tree", "eagle3-hybrid"):
        got = model.generate(input_ids=ids, max_new_tokens=500, ignore_eos=True, drafter=drafter, draft_len=6)
        assert got.tokens == plain.tokens and got.finish_reason == plain.finish_reason, drafter


@pytest.mark.parametrize("dtype, op", [("int8", "MatMulQ8"), ("int4", "MatMulQ4")])
def test_a_quantized_head_drafts_like_the_fp32_one_and_stays_lossless(eagle3_bundle, tmp_path, dtype, op):
    """`--dtype int8|int4` runs the head's MatMuls on the op library's kernels: its drafts are
    mostly the fp32 head's, and the output is still the target's own."""
    import json
    import shutil

    import onnx

    from dflash.export.cli import export_eagle3
    from dflash.runtime import Model

    bundle = tmp_path / "bundle"
    shutil.copytree(eagle3_bundle, bundle)
    head = json.loads((bundle / "dflash.json").read_text())["eagle3"]["source"]
    manifest = export_eagle3(head, bundle, dtype)
    graph = manifest["graphs"]["eagle3"]
    assert graph == {"file": f"eagle3_{dtype}.onnx", "dtype": dtype, "matmul": op.replace("MatMul", "").lower()}
    assert not (bundle / "eagle3.onnx").exists()
    ops = {n.op_type for n in onnx.load(bundle / graph["file"], load_external_data=False).graph.node}
    assert op in ops and "MatMul" not in ops  # every weight MatMul quantized (attention runs in TreeAttention)

    ids = list(range(4, 40, 3))
    drafts = {}
    for name, folder in (("fp32", eagle3_bundle), (dtype, bundle)):
        model = Model(folder)
        plain = model.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True).tokens
        for drafter in ("eagle3", "eagle3-tree"):
            assert model.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True, drafter=drafter).tokens == plain
        drafter = model.drafter("eagle3", 4)
        drafts[name], propose = [], drafter.propose
        drafter.propose = lambda history, room: drafts[name].append(propose(history, room)) or drafts[name][-1]
        model.generate(input_ids=ids, max_new_tokens=40, ignore_eos=True, drafter="eagle3", draft_len=4)
    first = [(a.tokens, b.tokens) for a, b in zip(drafts["fp32"], drafts[dtype])][:3]  # same histories
    agree = np.mean([x == y for a, b in first for x, y in zip(a, b)])
    assert agree >= 0.5, (drafts, agree)
