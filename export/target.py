"""The target graph: a decoder that verifies a tree of tokens against a fixed KV cache.

Inputs   input_ids [1,S] int64, position_ids [1,S] int64 (prefix length + tree depth),
         tree_mask [S,S] bool (row i may see new row j), past_len [] int64,
         past_key_i / past_value_i [1,Hkv,C,W] for every layer i: float32 (W = D), or with
         `--kv-dtype` float16 (W = D) or int8 rows (uint8, W = D + 4*ceil(D/32); dflash.ops).
Outputs  logits [1,S,V], taps [1,S,T*H] (outputs of the tap layers, concatenated),
         present_key_i / present_value_i: the same buffers with rows past_len..past_len+S-1
         written; the runtime binds them to the past buffers so the update is in place.

The batched graph (`export --batched`, for the training data job) is the same decoder over B
sequences: every input and output has B as its first dimension, past_len is [B] (each
sequence's own length), the caches are [B,Hkv,C,D] with any capacity C, and one tree_mask
serves all sequences.  Each sequence gets the bits it gets alone.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import torch

from . import ops


def default_taps(num_layers: int, count: int = 5) -> list[int]:
    """DFlash's rule: `count` layer ids evenly spaced from 1 to N-3 (id i = output of layer i).

    Small models get the distinct ids that rule leaves once clamped into range."""
    if count == 1:
        return [num_layers // 2]
    start, end = 1, max(1, num_layers - 3)
    ids = {min(num_layers - 1, round(start + i * (end - start) / (count - 1))) for i in range(count)}
    return sorted(ids)


def _fuse_linears(*linears) -> torch.nn.Linear:
    """One Linear computing several that share an input (one MatMul instead of many)."""
    weight = torch.cat([m.weight for m in linears], dim=0)
    has_bias = [m.bias is not None for m in linears]
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=any(has_bias))
    fused.weight = torch.nn.Parameter(weight, requires_grad=False)
    if any(has_bias):
        bias = [m.bias if m.bias is not None else torch.zeros(m.out_features) for m in linears]
        fused.bias = torch.nn.Parameter(torch.cat(bias), requires_grad=False)
    return fused


class DecoderLayer(torch.nn.Module):
    """A Llama-family decoder layer (Llama, Qwen2, Qwen3) over the cached-attention op,
    built from the Hugging Face layer's own weights."""

    def __init__(self, layer, config, fused_ops: bool = False):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scale = float(attn.scaling)
        self.eps = float(config.rms_norm_eps)
        self.qkv = _fuse_linears(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o_proj = attn.o_proj
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.gate_up = _fuse_linears(mlp.gate_proj, mlp.up_proj)
        self.down = mlp.down_proj
        self.act = mlp.act_fn
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.split = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        # PackedTreeAttention: one node a layer instead of Split + 2 RotaryEmbedding + attention.
        # Not for q/k-normed models (Qwen3): the norms sit between the projection and the rotary.
        self.fused = fused_ops and self.q_norm is None and self.k_norm is None
        self.fused_ops = fused_ops  # the SwiGLU op (silu only: checked where the layers are built)

    def _head_norm(self, norm, x, heads):
        if norm is None:
            return x
        b, s = x.shape[:2]
        return ops.rms_norm(x.view(b, s, heads, self.head_dim), norm.weight, self.eps).view(b, s, -1)

    def forward(self, x, hidden, position_ids, cos, sin, io, i, next_norm):
        """x = input_norm(hidden) -> (next_norm(new hidden), new hidden): each residual add is
        fused with the norm that follows it."""
        if self.fused:
            attn, io.key_out[i], io.value_out[i] = ops.packed_attention(
                self.qkv(x), io.key_caches[i], io.value_caches[i], io.past_len, io.mask, position_ids, cos, sin,
                self.scale, self.heads, self.kv_heads)
        else:
            q, k, v = self.qkv(x).split(self.split, dim=-1)
            q = ops.rotary(self._head_norm(self.q_norm, q, self.heads), position_ids, cos, sin, self.heads)
            k = ops.rotary(self._head_norm(self.k_norm, k, self.kv_heads), position_ids, cos, sin, self.kv_heads)
            attn, io.key_out[i], io.value_out[i] = ops.cached_attention(
                q, k, v, io.key_caches[i], io.value_caches[i], io.past_len, io.mask,
                self.scale, self.heads, self.kv_heads)
        x, hidden = ops.add_rms_norm(self.o_proj(attn), hidden, self.post_norm.weight, self.eps)
        if self.fused_ops:
            return ops.add_rms_norm(self.down(ops.swiglu(self.gate_up(x))), hidden, next_norm.weight, self.eps)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return ops.add_rms_norm(self.down(self.act(gate) * up), hidden, next_norm.weight, self.eps)


class CacheIO:
    """The caches one forward reads and the updated caches it returns."""

    def __init__(self, caches, past_len, mask):
        self.key_caches, self.value_caches = caches[0::2], caches[1::2]
        self.past_len, self.mask = past_len, mask
        self.key_out = [None] * len(self.key_caches)
        self.value_out = [None] * len(self.key_caches)


def rotary_tables(rotary_emb, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_len, D/2] from the model's own rotary module (any rope scaling)."""
    positions = torch.arange(max_len).unsqueeze(0)
    dummy = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary_emb(dummy, positions)
    half = cos.shape[-1] // 2
    return cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()


class TargetGraph(torch.nn.Module):
    def __init__(self, model, taps: list[int], max_len: int, fused_ops: bool = False):
        super().__init__()
        config = model.config
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported; export a full-attention model")
        self.embed, self.norm = model.model.embed_tokens, model.model.norm
        # A [H, V] weight of its own: a plain MatMul over an initializer, which the int4/int8
        # quantizer can rewrite even when the model ties lm_head to the embedding.
        self.lm_head = torch.nn.Parameter(model.lm_head.weight.detach().t().contiguous(), requires_grad=False)
        self.lm_head_bias = getattr(model.lm_head, "bias", None)
        self.layers = torch.nn.ModuleList(DecoderLayer(layer, config, fused_ops) for layer in model.model.layers)
        self.eps = float(config.rms_norm_eps)
        self.taps = list(taps)
        cos, sin = rotary_tables(model.model.rotary_emb, max_len)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def project(self, x):
        """The lm_head product (a method, so the export check can swap in a quantized reference)."""
        return x @ self.lm_head

    def forward(self, input_ids, position_ids, tree_mask, past_len, *caches):
        io = CacheIO(caches, past_len, tree_mask)
        hidden = self.embed(input_ids)
        x = ops.rms_norm(hidden, self.layers[0].input_norm.weight, self.eps)
        next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        tapped = []
        for i, (layer, next_norm) in enumerate(zip(self.layers, next_norms)):
            x, hidden = layer(x, hidden, position_ids, self.cos, self.sin, io, i, next_norm)
            if i in self.taps:
                tapped.append(hidden)
        logits = self.project(x)
        if self.lm_head_bias is not None:
            logits = logits + self.lm_head_bias
        presents = [t for pair in zip(io.key_out, io.value_out) for t in pair]
        return (logits, torch.cat(tapped, dim=-1), *presents)


def cache_names(num_layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    present = [f"present_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    return past, present


def kv_layout(config, kv_dtype: str = "fp32") -> dict:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"layers": config.num_hidden_layers, "kv_heads": config.num_key_value_heads,
            "heads": config.num_attention_heads, "head_dim": head_dim, "dtype": kv_dtype}


def store_kv_as(model, kv_dtype: str, head_dim: int) -> None:
    """Type the graph's cache inputs and outputs (past_*, present_*) for the KV format kv_dtype:
    TreeAttention stores and reads its rows in the caches' own type (dflash.ops.KV_DTYPES)."""
    from dflash.ops import KV_DTYPES, kv_row_width

    names = ("past_key_", "past_value_", "present_key_", "present_value_")
    for value in (*model.graph.input, *model.graph.output):
        if value.name.startswith(names):
            tensor = value.type.tensor_type
            tensor.elem_type = KV_DTYPES[kv_dtype][1]
            tensor.shape.dim[3].dim_value = kv_row_width(kv_dtype, head_dim)
    kept = [v for v in model.graph.value_info if not v.name.startswith(names)]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)


def store_graph_kv_as(path: Path, kv_dtype: str, head_dim: int) -> None:
    """store_kv_as on a saved graph (its weights stay in the external data file)."""
    if kv_dtype == "fp32":
        return
    model = onnx.load(str(path), load_external_data=False)
    store_kv_as(model, kv_dtype, head_dim)
    onnx.save(model, str(path))


def example_inputs(config, max_len: int, s: int = 3, past: int = 2, seed: int = 0, batch: int | None = None):
    """Random inputs of the graph's form: S new rows (causal) after `past` cached rows.  `batch`:
    that many sequences, sequence b after past + b rows (past_len [B]); None: one, past_len []."""
    g = torch.Generator().manual_seed(seed)
    layout = kv_layout(config)
    pasts = torch.arange(past, past + (batch or 1))
    ids = torch.randint(0, config.vocab_size, (batch or 1, s), generator=g)
    pos = pasts[:, None] + torch.arange(s)[None, :]
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    shape = (batch or 1, layout["kv_heads"], max_len, layout["head_dim"])
    caches = [torch.randn(shape, generator=g) * 0.5 for _ in range(2 * layout["layers"])]
    past_len = pasts if batch else torch.tensor(past, dtype=torch.int64)
    return (ids, pos, mask, past_len, *caches)


def export_onnx(model, taps: list[int], max_len: int, attention: str, path, batched: bool = False) -> None:
    """torch.onnx.export(dynamo=True) of the target graph into `path` (+ external data); `batched`:
    the batched graph (see the module docstring)."""
    if batched and attention != "custom":
        raise ValueError(f"a batched target graph needs --attention custom (this project's ops), not {attention}")
    graph = TargetGraph(model, taps, max_len, fused_ops=attention == "custom").eval()
    n = model.config.num_hidden_layers
    past, present = cache_names(n)
    s = torch.export.Dim("S", min=1, max=max_len)
    dynamic = {"input_ids": {1: s}, "position_ids": {1: s}, "tree_mask": {0: s, 1: s},
               "past_len": None, "caches": (None,) * (2 * n)}
    if batched:
        b, c = torch.export.Dim("B", min=1, max=1024), torch.export.Dim("C", min=2, max=max_len)
        dynamic.update(input_ids={0: b, 1: s}, position_ids={0: b, 1: s}, past_len={0: b},
                       caches=({0: b, 2: c},) * (2 * n))
    with torch.no_grad():
        # torch.export first: torch.onnx.export's own wrapper mangles the varargs' dynamic shapes.
        exported = torch.export.export(graph, example_inputs(model.config, max_len, batch=2 if batched else None),
                                       dynamic_shapes=dynamic, strict=False)
        program = torch.onnx.export(
            exported, dynamo=True,
            input_names=["input_ids", "position_ids", "tree_mask", "past_len", *past],
            output_names=["logits", "taps", *present],
            custom_translation_table=ops.translation_table(attention),
            opset_version=23 if attention == "onnx" else 20,
            optimize=True, verbose=False,
        )
    program.save(str(path), external_data=True)
