"""The target graph: a decoder that verifies a tree of tokens against a fixed KV cache.

Inputs   input_ids [1,S] int64, position_ids [1,S] int64 (prefix length + tree depth),
         tree_mask [S,S] bool (row i may see new row j), past_len [] int64,
         past_key_i / past_value_i [1,Hkv,C,D] float32 for every layer i.
Outputs  logits [1,S,V], taps [1,S,T*H] (outputs of the tap layers, concatenated),
         present_key_i / present_value_i: the same buffers with rows past_len..past_len+S-1
         written; the runtime binds them to the past buffers so the update is in place.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from .attention import CacheIO, hf_attention

AttentionInterface.register("dflash", hf_attention)


def default_taps(num_layers: int, count: int = 5) -> list[int]:
    """DFlash's rule: `count` layer ids evenly spaced from 1 to N-3 (id i = output of layer i).

    Small models get the distinct ids that rule leaves once clamped into range."""
    if count == 1:
        return [num_layers // 2]
    start, end = 1, max(1, num_layers - 3)
    ids = {min(num_layers - 1, round(start + i * (end - start) / (count - 1))) for i in range(count)}
    return sorted(ids)


class TargetGraph(torch.nn.Module):
    def __init__(self, model, taps: list[int]):
        super().__init__()
        self.model = model
        self.taps = list(taps)
        model.config._attn_implementation = "dflash"

    def forward(self, input_ids, position_ids, tree_mask, past_len, *caches):
        inner = self.model.model
        io = CacheIO(caches[0::2], caches[1::2], past_len, tree_mask)
        hidden = inner.embed_tokens(input_ids)
        rotary = inner.rotary_emb(hidden, position_ids)
        tapped = []
        for i, layer in enumerate(inner.layers):
            hidden = layer(hidden, position_embeddings=rotary, position_ids=position_ids, dflash_io=io)
            if i in self.taps:
                tapped.append(hidden)
        logits = self.model.lm_head(inner.norm(hidden))
        presents = [t for pair in io.presents for t in pair]
        return (logits, torch.cat(tapped, dim=-1), *presents)


def cache_names(num_layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    present = [f"present_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    return past, present


def kv_layout(config) -> dict:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"layers": config.num_hidden_layers, "kv_heads": config.num_key_value_heads,
            "heads": config.num_attention_heads, "head_dim": head_dim}


def example_inputs(config, max_len: int, s: int = 3, past: int = 2, seed: int = 0):
    """Random inputs of the graph's form: S new rows (causal) after `past` cached rows."""
    g = torch.Generator().manual_seed(seed)
    layout = kv_layout(config)
    ids = torch.randint(0, config.vocab_size, (1, s), generator=g)
    pos = torch.arange(past, past + s).unsqueeze(0)
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    shape = (1, layout["kv_heads"], max_len, layout["head_dim"])
    caches = [torch.randn(shape, generator=g) * 0.5 for _ in range(2 * layout["layers"])]
    return (ids, pos, mask, torch.tensor(past, dtype=torch.int64), *caches)


def export_onnx(model, taps: list[int], max_len: int, attention: str, path) -> None:
    """torch.onnx.export(dynamo=True) of the target graph into `path` (+ external data)."""
    from .attention import translation_table

    graph = TargetGraph(model, taps).eval()
    n = model.config.num_hidden_layers
    past, present = cache_names(n)
    s = torch.export.Dim("S", min=1, max=max_len)
    dynamic = {"input_ids": {1: s}, "position_ids": {1: s}, "tree_mask": {0: s, 1: s},
               "past_len": None, "caches": (None,) * (2 * n)}
    with torch.no_grad():
        # torch.export first: torch.onnx.export's own wrapper mangles the varargs' dynamic shapes.
        exported = torch.export.export(graph, example_inputs(model.config, max_len),
                                       dynamic_shapes=dynamic, strict=False)
        program = torch.onnx.export(
            exported, dynamo=True,
            input_names=["input_ids", "position_ids", "tree_mask", "past_len", *past],
            output_names=["logits", "taps", *present],
            custom_translation_table=translation_table(attention),
            optimize=True, verbose=False,
        )
    program.save(str(path), external_data=True)
