"""After export: run the graph in ONNX Runtime and a torch reference on the same random inputs,
and fail if they disagree.

For a quantized graph the reference computes what its MatMuls should compute: the source
weights as the export's weight plan quantizes them (export/quantize.py: a GGUF's own blocks,
searched or symmetric blocks of 32 along K; without a plan, symmetric blocks, as ORT's symmetric
MatMulNBits quantizes), dequantized here from the plan's codes, not read back from the graph,
and the activations quantized to int8 per block of 32 (MatMulQ4, MatMulQ8 and MatMulNBits
accuracy level 4).  On tiny models the graph matches it to 1e-6; on real models with
outlier activations a few int8 roundings flip and grow through the layers, so a quantized graph
must stay within a share of the distance quantization moves the model from fp32 (QUANTIZED_SHARE;
measured on SmolLM2-135M: 0.03-0.09 of it with MatMulQ4).  A graph whose quantized weights are
wrong fails."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

BLOCK = 32
TOLERANCE = 1e-3  # allowed |ORT - reference|, relative to the reference's largest magnitude (+1)
# Quantized graphs: allowed |ORT - reference| as a share of |reference - fp32|, per MatMul kernel.
# MatMulQ4 and MatMulQ8 are ours and round exactly as the reference; ORT's MatMulNBits agrees to
# 1e-6 on small activations but drifts on SmolLM2's outliers (measured: 0.8 of the quantization
# distance at int8), so for it the check only says the graph is no further from the reference than
# quantization moves the model.
QUANTIZED_SHARE = {"q4": 0.25, "q8": 0.25, "nbits": 1.0}


def quantized_activations(x: torch.Tensor, split: bool = False) -> torch.Tensor:
    """x [..., K] round-tripped through int8 per block of 32, rounded as the ops round: in float32,
    x * (127 / block max); `split`: plus its residual round-tripped the same way (the ops'
    split_activations)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    q = torch.clamp(torch.round(blocks * inv), -127, 127)
    out = (q.double() * (amax / 127).double()).reshape(x.shape)
    if split:
        residual = (x.double() - out).float()
        out = out + quantized_activations(residual)
    return out


@contextmanager
def quantized_reference(graph, plan):
    """Within the block, `graph` (a TargetGraph) computes its MatMuls as a quantized export with
    weight plan `plan` (export/quantize.py) does."""
    def product(weight_kn, lm_head=False):
        wq = torch.from_numpy(plan(weight_kn.numpy(), lm_head=lm_head).dequantized()).double()
        return lambda x: (quantized_activations(x, plan.split_activations) @ wq).float()

    patched = []
    for module in graph.modules():
        if isinstance(module, torch.nn.Linear) and module.in_features % BLOCK == 0:
            mm, bias = product(module.weight.detach().t()), module.bias
            module.forward = (lambda x, mm=mm, bias=bias: mm(x) + bias if bias is not None else mm(x))
            patched.append(module)
    if graph.lm_head.shape[0] % BLOCK == 0:
        graph.project = product(graph.lm_head.detach(), lm_head=True)
    try:
        yield graph
    finally:
        for module in patched:
            del module.forward
        graph.__dict__.pop("project", None)


def check_target(model, taps: list[int], bundle: Path, s: int = 5, past: int = 7, plan=None) -> dict:
    """{logits, taps}: max |ORT - reference| for S new rows after `past` random cached rows,
    their bounds, and `passed`. `plan`: the weight plan the graph was quantized with (default:
    symmetric blocks)."""
    from dflash.runtime.bundle import load_bundle
    from dflash.runtime.session import make_session

    from .quantize import BITS, WeightPlan
    from .target import TargetGraph, example_inputs

    info = load_bundle(bundle)
    session = make_session(info.graph_path("target"), info, threads=None)
    inputs = example_inputs(model.config, info.max_len, s=s, past=past, seed=1)
    feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs)}
    logits, tapped = session.run(["logits", "taps"], feeds)
    dtype = info.manifest["graphs"]["target"]["dtype"]
    with torch.no_grad():
        ref = [t.numpy() for t in TargetGraph(model, taps, info.max_len)(*inputs)[:2]]
        if dtype in BITS:
            graph = TargetGraph(model, taps, info.max_len)
            plan = plan or WeightPlan(dtype, symmetric_only=True)
            with quantized_reference(graph, plan):
                ref, fp32 = [t.numpy() for t in graph(*inputs)[:2]], ref
    result = {}
    for i, (name, got) in enumerate((("logits", logits), ("taps", tapped))):
        result[name] = float(np.abs(got - ref[i]).max())
        bound = TOLERANCE * (1 + np.abs(ref[i]).max())
        if dtype in BITS:
            # On a real model an int8 activation that rounds the other way (the inputs differ in the
            # last bits) grows through the layers; what the graph must do is stay far closer to the
            # quantized reference than quantization moves the model.
            share = QUANTIZED_SHARE[info.manifest["graphs"]["target"]["matmul"]]
            bound = max(bound, share * float(np.abs(ref[i] - fp32[i]).max()))
        result[f"{name}_bound"] = float(bound)
    result["passed"] = all(result[n] <= result[f"{n}_bound"] for n in ("logits", "taps"))
    return result


def check_batched(config, bundle: Path, batch: int = 2, s: int = 5, past: int = 7) -> bool:
    """Whether the batched target graph gives every sequence of a batch exactly the logits and
    taps the target graph gives it alone (random ids and caches; sequence b after past + b rows)."""
    from dflash.runtime.bundle import load_bundle
    from dflash.runtime.session import make_session

    from .target import example_inputs

    info = load_bundle(bundle)
    single = make_session(info.graph_path("target"), info, threads=None)
    batched = make_session(info.graph_path("target_batched"), info, threads=None)
    inputs = [t.numpy() for t in example_inputs(config, info.max_len, s=s, past=past, seed=2, batch=batch)]
    names = [i.name for i in batched.get_inputs()]
    logits, tapped = batched.run(["logits", "taps"], dict(zip(names, inputs)))
    for b in range(batch):
        alone = [x[b : b + 1] for x in inputs]
        alone[2], alone[3] = inputs[2], np.array(inputs[3][b])  # the shared mask; a scalar past length
        want = single.run(["logits", "taps"], dict(zip(names, alone)))
        if not (np.array_equal(logits[b], want[0][0]) and np.array_equal(tapped[b], want[1][0])):
            return False
    return True
