"""Faults and contradictions: a failure mid-step leaves the Model usable and the next
generation exact; a manifest that contradicts its graph is refused at load."""

import json
import shutil

import pytest

from dflash.runtime import BundleError, Model


@pytest.fixture(scope="module")
def model(spec_bundle):
    return Model(spec_bundle())


IDS = list(range(4, 70, 3))


@pytest.mark.parametrize("drafter", [None, "lookup", "self-int8", "self-int8-tree"])
@pytest.mark.parametrize("where", ["draft", "verify", "consumer"])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failure_mid_step_leaves_the_model_usable(model, drafter, where, error):
    if where == "draft" and drafter is None:
        pytest.skip("no drafter")
    plain = model.generate(input_ids=IDS, max_new_tokens=30, ignore_eos=True)
    calls = {"n": 0}

    def failing(original):
        def wrapper(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 4:
                raise error("injected")
            return original(*args, **kwargs)
        return wrapper

    generation = model.stream(input_ids=IDS, max_new_tokens=30, ignore_eos=True, drafter=drafter)
    target = model.target
    patched = None
    if where == "draft":
        patched = (generation.drafter, "propose", generation.drafter.propose)
    elif where == "verify":
        patched = (target, "forward", target.forward)
    if patched:
        setattr(patched[0], patched[1], failing(patched[2]))
    try:
        with pytest.raises(error, match="injected"):
            for n, _ in enumerate(generation):
                if where == "consumer" and n == 3:
                    raise error("injected")
    finally:
        if patched:
            setattr(*patched)
    # a consumer that stops reading closes the stream: "stop"; a failure inside it: "error"
    assert generation.result.finish_reason == ("stop" if where == "consumer" else "error")
    again = model.generate(input_ids=IDS, max_new_tokens=30, ignore_eos=True, drafter=drafter)
    assert again.tokens == plain.tokens and again.finish_reason == "length"


def test_concurrent_generation_on_one_model_is_refused(model):
    first = iter(model.stream(input_ids=IDS, max_new_tokens=10))
    next(first)
    with pytest.raises(RuntimeError, match="already generating"):
        model.generate(input_ids=IDS, max_new_tokens=5)
    first.close()
    assert len(model.generate(input_ids=IDS, max_new_tokens=5, ignore_eos=True).tokens) == 5


@pytest.mark.parametrize("field, value, message", [
    ("vocab_size", 999, r"logits is \[1, .*\] in the graph, \[1, None, 999\] by the manifest"),
    ("taps", [0, 1], "taps is"),
    ("kv", {"layers": 3, "kv_heads": 2, "heads": 4, "head_dim": 16}, "3 layers in the manifest, 4 in the graph"),
    ("max_len", 64, "past_key_0 is"),
])
def test_manifest_contradicting_the_graph_is_refused(tiny, tmp_path, field, value, message):
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny("llama")[0], bundle)
    manifest = json.loads((bundle / "dflash.json").read_text())
    manifest[field] = value
    (bundle / "dflash.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=f"contradicts target.onnx.*{message}"):
        Model(bundle)


def test_truncated_graph_is_refused_with_the_file_named(tiny, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny("llama")[0], bundle)
    graph = bundle / "target.onnx"
    graph.write_bytes(graph.read_bytes()[: graph.stat().st_size // 2])
    with pytest.raises(BundleError, match="could not load .*target.onnx"):
        Model(bundle)
