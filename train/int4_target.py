"""A torch target that computes like an int4 bundle, for labelling data the way users run it.

An int4 bundle's MatMuls run on MatMulQ4 (and MatMulQ8 for the lm_head): weights in blocks of 32
along K as the export's weight plan makes them (export/quantize.py: a GGUF's own blocks, searched
blocks from other sources), and activations quantized to int8 per block of 32
(ops/quantized_matmul.h). Here every Linear of a transformers model gets the same dequantized
weights and quantizes its input the same way in a forward pre-hook. The result differs from the
int4 graph only in float summation order.
"""

from __future__ import annotations

import numpy as np


def quantize_input(module, args):
    """Forward pre-hook: the input rounded as MatMulQ4 quantizes it (ops/reference.py: per block of
    32, int8). Labelling runs without gradients, so the round trip through numpy costs little."""
    import torch

    from dflash.ops.reference import quantize_activations

    x = args[0]
    q, scale = quantize_activations(x.detach().float().numpy())
    return torch.from_numpy((q * scale[..., None]).astype(np.float32).reshape(x.shape)),


def emulate_int4(model, source_path: str | None = None):
    """Give every Linear with a multiple of 32 inputs (what the exporter quantizes) the int4
    bundle's weights and input rounding, in place; returns the model. `source_path`: the model's
    GGUF or folder, whose export's weight plan gives the weights (None: symmetric blocks, the
    plan of drafters). Tied embeddings are untied first: the embedding table stays fp32 in the
    bundle."""
    import torch

    from dflash.export.quantize import WeightPlan, weight_plan

    plan = weight_plan(source_path, "int4") if source_path else WeightPlan("int4", symmetric_only=True)
    head = model.get_output_embeddings()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.in_features % 32 == 0:
            w = module.weight.detach().float().t().numpy()  # [K, N], as the exported MatMul holds it
            dequantized = plan(w, lm_head=module is head).dequantized().T.copy()
            module.weight = torch.nn.Parameter(torch.from_numpy(dequantized), requires_grad=False)
            module.register_forward_pre_hook(quantize_input)
    return model
