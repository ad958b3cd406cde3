"""int4 from a Hugging Face source (export/blocks.py, export/imatrix.py): searched asymmetric
blocks weighted by an importance matrix beat round-to-nearest on the activation-weighted error,
and the export writes exactly the plan's weights."""

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from dflash.export import blocks
from dflash.ops import reference
from tiny_models import TEXT


def graph_weights(path):
    """[(op type, dequantized W)] of the graph's MatMulQ4 / MatMulQ8 nodes, or its plain MatMul
    weights, in node order."""
    model = onnx.load(str(path))
    init = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if node.op_type in ("MatMulQ4", "MatMulQ8"):
            params = [init[n] for n in node.input[1:]]
            N = next(a.i for a in node.attribute if a.name == "N")
            bits = 4 if node.op_type == "MatMulQ4" else 8
            out.append((node.op_type, reference.dequantize(params[0], params[1], N, bits, *params[2:])))
        elif node.op_type == "MatMul" and node.input[1] in init:
            out.append(("MatMul", init[node.input[1]]))
    return out


def test_the_search_beats_round_to_nearest_on_activation_weighted_error(tiny, tmp_path):
    """The calibrated int4 export of a tiny random model, weight by weight against its fp32
    export: sum_k E[a_k^2] (w_hat - w)^2 below both round-to-nearest forms, symmetric (today's
    int4) and asymmetric min/max (the search switched off); the lm_head int8."""
    from dflash.export import sources
    from dflash.export.imatrix import importance, weight_key

    calibration = tmp_path / "calibration.txt"
    calibration.write_text(TEXT)
    bundle, hf = tiny("llama", dtype="int4", calibration=calibration)
    fp32, _ = tiny("llama")
    source = sources.load(str(hf))
    imp = importance(source.model, source.tokenizer(TEXT)["input_ids"])
    quantized = graph_weights(bundle / "target_int4.onnx")
    reference_weights = graph_weights(fp32 / "target.onnx")
    assert [kind for kind, _ in quantized] == ["MatMulQ4"] * 16 + ["MatMulQ8"]
    totals = {"searched": 0.0, "minmax": 0.0, "symmetric": 0.0}
    for (kind, got), (_, w) in zip(quantized[:-1], reference_weights[:-1]):
        e = imp[weight_key(w)][:, None]
        err = lambda w_hat: float((e * (w_hat - w) ** 2).sum())
        totals["searched"] += err(got)
        totals["minmax"] += err(blocks.minmax(w, 4).dequantized())
        totals["symmetric"] += err(blocks.symmetric(w, 4).dequantized())
    assert totals["searched"] < 0.9 * totals["minmax"] < 0.9 * totals["symmetric"], totals
    head, head_w = quantized[-1][1], reference_weights[-1][1]
    assert np.abs(head - head_w).max() <= np.abs(head_w).max() / 127  # int8: within a step of 1/127


def test_the_importance_matrix_is_the_mean_square_of_each_linear_input(tiny):
    """E[a^2] per input row for every projection of every layer and the lm_head, keyed by value."""
    import torch

    from dflash.export import sources
    from dflash.export.imatrix import importance, weight_key

    _, hf = tiny("llama")
    model = sources.load(str(hf)).model
    ids = list(range(3, 60))
    imp = importance(model, ids, window=32)
    assert len(imp) == 4 * 4 + 1
    head = imp[weight_key(model.lm_head.weight.detach().t().numpy())]
    with torch.no_grad():  # the lm_head's input: the final norm's output, window by window
        parts = [model.model(torch.tensor([ids[s:s + 32]])).last_hidden_state[0] for s in (0, 32)]
    want = torch.cat(parts).double().pow(2).mean(0).numpy()
    np.testing.assert_allclose(head, want, rtol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_searched_blocks_fit_their_grid_and_half_parameters(bits):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((128, 40)) * 0.05).astype(np.float32)
    w[:32, 3] = 0.1  # a constant block
    weight = blocks.searched(w, bits)
    assert weight.codes.max() <= 2 ** bits - 1 and weight.offsets is not None
    packed = weight.packed()
    assert packed[1].dtype == packed[2].dtype == np.float16  # exact: the search rounds to them
    np.testing.assert_array_equal(reference.dequantize(packed[0], *packed[1:2], 40, bits, packed[2]),
                                  weight.dequantized())
    assert np.abs(weight.dequantized()[:32, 3] - 0.1).max() < 1e-4


def test_an_int4_lm_head_is_asked_for_and_checked(tiny):
    """--lm-head int4: every MatMul MatMulQ4 (searched); it applies to int4 targets only."""
    from dflash.export.cli import export_target
    from dflash.export.sources import SourceError

    bundle, hf = tiny("llama", dtype="int4", lm_head="int4")
    assert [kind for kind, _ in graph_weights(bundle / "target_int4.onnx")] == ["MatMulQ4"] * 17
    assert generates(bundle)
    with pytest.raises(SourceError, match="--lm-head int4 applies to int4 targets"):
        export_target(str(hf), bundle.parent / "other", dtype="int8", lm_head="int4")


def generates(bundle) -> bool:
    from dflash.runtime import Model

    return Model(bundle).generate("the quick brown fox", max_new_tokens=4).stats.new_tokens >= 1


def test_split_activations_export_runs_every_op_with_them(tiny):
    """--split-activations: every MatMulQ4 / MatMulQ8 carries the attribute, the export check
    (whose reference splits too) passes, and the bundle's logits are closer to fp32's than plain
    int4's are."""
    from dflash.runtime import Model

    split, _ = tiny("llama", dtype="int4", split_activations=True)
    plain, _ = tiny("llama", dtype="int4")
    fp32, _ = tiny("llama")
    graph = onnx.load(str(split / "target_int4.onnx"), load_external_data=False).graph
    ops = [n for n in graph.node if n.op_type in ("MatMulQ4", "MatMulQ8")]
    assert len(ops) == 17 and all(any(a.name == "split_activations" and a.i == 1 for a in n.attribute) for n in ops)
    model = Model(split)
    assert model.bundle.graphs["target"]["split_activations"] and model.bundle.export_check["passed"]
    ids = list(range(5, 30))
    logits = {name: Model(b).target.forward(ids, np.arange(len(ids)), np.tri(len(ids), dtype=bool), 0)
              for name, b in (("split", split), ("plain", plain), ("fp32", fp32))}
    # the weights differ from fp32's alike; split takes the activations' rounding away
    exact = logits["fp32"]
    assert np.abs(logits["split"] - exact).max() < np.abs(logits["plain"] - exact).max()
