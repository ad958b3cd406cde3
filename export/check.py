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

    from .quantize import BITS, WeightPlan
    from .target import TargetGraph, example_inputs

    info = load_bundle(bundle)
    inputs = example_inputs(model.config, info.max_len, s=s, past=past, seed=1)
    (logits, tapped), kv = run_checked(bundle, [t.numpy() for t in inputs[:4]], [t.numpy() for t in inputs[4:]])
    dtype = info.manifest["graphs"]["target"]["dtype"]
    with torch.no_grad():
        ref = [t.numpy() for t in TargetGraph(model, taps, info.max_len)(*inputs)[:2]]
        if dtype in BITS:
            graph = TargetGraph(model, taps, info.max_len)
            plan = plan or WeightPlan(dtype, symmetric_only=True)
            with quantized_reference(graph, plan):
                ref, fp32 = [t.numpy() for t in graph(*inputs)[:2]], ref
    matmul = info.manifest["graphs"]["target"]["matmul"]
    return kv(bounds([logits, tapped], ref, fp32 if dtype in BITS else None, matmul))


def run_checked(bundle: Path, inputs: list, caches: list, resident: bool = True):
    """The check's run of the bundle's target graph on `inputs` (ids, positions, mask, past) and
    float32 `caches`: ([logits, taps], kv) where kv(result) adds to a check's result what the KV
    format does. A graph whose cache stores fp16 / int8 rows is checked through its twin with
    float32 caches (the same nodes and weights, written beside it for the run, then removed), so
    its bounds are a float32 cache's: a new value near a rounding edge of the format can be stored
    a step apart by ORT and by torch (their float32 sums differ in the last bits), and on a real
    model int8 activations amplify that step past any useful bound (SmolLM2 int4: taps 314 apart
    for an fp16 cache, 7 for a float32 one). The graph itself then runs on the caches stored in its
    format: how far that moves the logits is recorded (`kv_logits`), and must be finite. That rows
    are stored and read exactly is the op's own test (tests/test_kv_formats.py)."""
    import onnx

    from dflash.runtime.bundle import load_bundle
    from dflash.runtime.session import make_session

    from .target import store_kv_as

    info = load_bundle(bundle)
    graph, kv_dtype = info.graph_path("target"), info.kv.get("dtype", "fp32")

    def run(path, cache_values):
        session = make_session(path, info, threads=None, resident=resident)
        names = [i.name for i in session.get_inputs()]
        return session.run(["logits", "taps"], dict(zip(names, inputs + cache_values)))

    if kv_dtype == "fp32":
        return run(graph, caches), lambda result: result
    twin = graph.with_name(f"{graph.stem}.fp32-cache.onnx")
    model = onnx.load(str(graph), load_external_data=False)
    store_kv_as(model, "fp32", info.kv["head_dim"])
    onnx.save(model, str(twin))
    try:
        got = run(twin, caches)
    finally:
        twin.unlink()
    stored, _ = stored_caches([torch.from_numpy(c) for c in caches], kv_dtype)
    moved = float(np.abs(run(graph, stored)[0] - got[0]).max())

    def kv(result: dict) -> dict:
        return {**result, "kv_logits": moved, "passed": result["passed"] and bool(np.isfinite(moved))}

    return got, kv


def stored_caches(caches, kv_dtype: str):
    """Random float caches as the graph takes them (numpy, in the KV format) and as its
    attention reads them back (torch float32): the inputs of ORT and of the reference."""
    from dflash.ops.reference import kv_load, kv_store

    stored = [kv_store(c.numpy(), kv_dtype) for c in caches]
    return stored, [torch.from_numpy(kv_load(c, kv_dtype, t.shape[-1])) for c, t in zip(stored, caches)]


def bounds(got, ref, fp32=None, matmul=None) -> dict:
    """{logits, taps}: max |ORT - reference| of the graph's outputs `got` against `ref`, their
    bounds and `passed`; `fp32` (quantized graphs): the fp32 model's outputs, whose distance from
    `ref` sets the bound."""
    result = {}
    for i, name in enumerate(("logits", "taps")):
        result[name] = float(np.abs(got[i] - ref[i]).max())
        bound = TOLERANCE * (1 + np.abs(ref[i]).max())
        if fp32 is not None:
            # On a real model an int8 activation that rounds the other way (the inputs differ in the
            # last bits) grows through the layers; what the graph must do is stay far closer to the
            # quantized reference than quantization moves the model.
            bound = max(bound, QUANTIZED_SHARE[matmul] * float(np.abs(ref[i] - fp32[i]).max()))
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
    inputs = example_inputs(config, info.max_len, s=s, past=past, seed=2, batch=batch)
    inputs = [t.numpy() for t in inputs[:4]] + stored_caches(inputs[4:], info.kv.get("dtype", "fp32"))[0]
    names = [i.name for i in batched.get_inputs()]
    logits, tapped = batched.run(["logits", "taps"], dict(zip(names, inputs)))
    for b in range(batch):
        alone = [x[b : b + 1] for x in inputs]
        alone[2], alone[3] = inputs[2], np.array(inputs[3][b])  # the shared mask; a scalar past length
        want = single.run(["logits", "taps"], dict(zip(names, alone)))
        if not (np.array_equal(logits[b], want[0][0]) and np.array_equal(tapped[b], want[1][0])):
            return False
    return True
