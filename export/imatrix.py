"""An importance matrix: for each MatMul weight of the target, the mean square of the activations
that multiply each of its input rows (E[a_k^2], as llama.cpp's `llama-imatrix` collects), measured
by running a calibration text through the fp32 target graph. The int4 search (export/blocks.py)
weights each weight's error by it, so the rows that meet large activations are kept closest.

Weights are named by value (`weight_key`): the exported graph's initializers are the same
arrays, under names the ONNX exporter chooses."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

WINDOW = 512  # tokens per forward, each window from an empty cache


def weight_key(w) -> bytes:
    """A [K, N] float32 weight's identity: a digest of its shape and values."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    return hashlib.blake2b(repr(w.shape).encode() + w.tobytes(), digest_size=16).digest()


def importance(model, ids: list[int], window: int = WINDOW) -> dict[bytes, np.ndarray]:
    """weight_key(W) -> E[a^2] [K] for every Linear of the target graph and its lm_head, over the
    token ids `ids` (windows of `window`)."""
    from .target import TargetGraph, kv_layout

    if len(ids) < 2:
        raise ValueError("the calibration text needs at least two tokens")
    graph = TargetGraph(model, [0], window).eval()
    sums: dict[bytes, np.ndarray] = {}
    rows = [0]

    def record(weight_kn: torch.Tensor, x: torch.Tensor) -> None:
        key = weight_key(weight_kn.detach().numpy())
        squares = x.detach().double().reshape(-1, x.shape[-1]).pow(2).sum(0).numpy()
        sums[key] = sums.get(key, 0) + squares

    hooks = [m.register_forward_pre_hook(lambda m, args: record(m.weight.t(), args[0]))
             for m in graph.modules() if isinstance(m, torch.nn.Linear)]
    project = graph.project
    graph.project = lambda x: (record(graph.lm_head, x), project(x))[1]
    layout = kv_layout(model.config)
    try:
        with torch.no_grad():
            for start in range(0, len(ids), window):
                chunk = torch.tensor([ids[start:start + window]])
                s = chunk.shape[1]
                caches = [torch.zeros(1, layout["kv_heads"], window, layout["head_dim"])
                          for _ in range(2 * layout["layers"])]
                graph(chunk, torch.arange(s)[None], torch.ones(s, s, dtype=torch.bool).tril(),
                      torch.tensor(0), *caches)
                rows[0] += s
    finally:
        for h in hooks:
            h.remove()
        graph.__dict__.pop("project", None)
    return {key: (total / rows[0]).astype(np.float32) for key, total in sums.items()}
