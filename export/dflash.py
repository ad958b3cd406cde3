"""DFlash block-diffusion drafters: the model (z-lab's checkpoint layout and config keys, so
a published folder loads as it is), a torch reference of one drafting step, and the ONNX
drafter graph.

A drafter step sees the target's tap features of the newly committed tokens (the context
rows) and a block [anchor, MASK x (B-1)] embedded with the target's embedding.  In every
layer the context rows give only keys and values (k_norm(k_proj(ctx)), rotary at their
absolute positions; v_proj(ctx)), which stay in the drafter's cache; the block rows attend
to all context rows and to each other (no causal mask), and the block's outputs after the
final norm go through the target's lm_head: logits for block positions 1..B-1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import ops
from .sources import SourceError


@dataclass
class DFlashConfig:
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    attention_bias: bool = False
    embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    softcap: float | None = None
    refine: bool = False  # trained with a refining second pass over its own drafts (dflash-train fit --refine)
    copy: bool = False  # reads what prompt lookup would copy into the block (dflash-train fit --copy)
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "DFlashConfig":
        arch = (d.get("architectures") or ["?"])[0]
        if arch != "DFlashDraftModel":
            raise SourceError(f"{where}: architecture {arch!r} is not a DFlash drafter "
                              "(expected DFlashDraftModel)")
        draft = d.get("dflash_config", {})

        def get(key, default=None):
            value = draft.get(key, d.get(key, default))
            if value is None:
                raise SourceError(f"{where} lacks {key!r}, which a DFlash drafter needs")
            return value

        heads = get("num_attention_heads")
        softcap = draft.get("final_logit_softcapping", d.get("final_logit_softcapping"))
        return cls(hidden_size=get("hidden_size"), layers=get("num_hidden_layers"), heads=heads,
                   kv_heads=get("num_key_value_heads"),
                   head_dim=d.get("head_dim") or get("hidden_size") // heads,
                   intermediate_size=get("intermediate_size"), eps=float(get("rms_norm_eps", 1e-6)),
                   vocab_size=get("vocab_size"), block_size=int(get("block_size", 16)),
                   mask_token_id=int(get("mask_token_id")), target_layer_ids=list(get("target_layer_ids")),
                   attention_bias=bool(d.get("attention_bias", False)),
                   embedding_scale=float(draft.get("input_embedding_scale", d.get("input_embedding_scale", 1.0))),
                   output_multiplier=float(draft.get("output_multiplier", d.get("output_multiplier", 1.0))),
                   softcap=float(softcap) if softcap else None, refine=bool(draft.get("refine", False)),
                   copy=bool(draft.get("copy", False)), raw=d)

    def rotary_tables(self, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [max_len, D/2], from transformers' Qwen3 rotary module (any rope scaling)."""
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        keys = {k: v for k, v in self.raw.items() if k not in ("architectures", "dflash_config", "auto_map")}
        rotary = Qwen3RotaryEmbedding(Qwen3Config(**keys))
        cos, sin = rotary(torch.zeros(1), torch.arange(max_len).unsqueeze(0))
        half = cos.shape[-1] // 2
        return cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


def _linear(n_in, n_out, bias=False):
    return torch.nn.Linear(n_in, n_out, bias=bias)


class Attention(torch.nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.q_proj = _linear(c.hidden_size, c.heads * c.head_dim, c.attention_bias)
        self.k_proj = _linear(c.hidden_size, c.kv_heads * c.head_dim, c.attention_bias)
        self.v_proj = _linear(c.hidden_size, c.kv_heads * c.head_dim, c.attention_bias)
        self.o_proj = _linear(c.heads * c.head_dim, c.hidden_size, c.attention_bias)
        self.q_norm, self.k_norm = RMSNorm(c.head_dim, c.eps), RMSNorm(c.head_dim, c.eps)


class MLP(torch.nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.gate_proj = _linear(c.hidden_size, c.intermediate_size)
        self.up_proj = _linear(c.hidden_size, c.intermediate_size)
        self.down_proj = _linear(c.intermediate_size, c.hidden_size)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(torch.nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.self_attn, self.mlp = Attention(c), MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.eps)


class DFlashDrafter(torch.nn.Module):
    """The drafter's own weights, named as in z-lab's checkpoints (fc, hidden_norm, layers.i.*, norm)."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.config = c
        self.fc = _linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size)
        self.hidden_norm = RMSNorm(c.hidden_size, c.eps)
        self.layers = torch.nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden_size, c.eps)
        if c.copy:  # see block_input
            self.copy_proj = _linear(c.hidden_size, c.hidden_size)
            self.copy_kind = torch.nn.Embedding(3, c.hidden_size)
        self.d2t: torch.Tensor | None = None  # reduced draft vocabulary, if trained with one

    def head(self, lm_head: torch.Tensor) -> torch.Tensor:
        """The target's lm_head [H, V], restricted to the draft vocabulary if there is one."""
        return lm_head if self.d2t is None else lm_head[:, self.d2t].contiguous()

    @classmethod
    def load(cls, folder) -> "DFlashDrafter":
        """A checkpoint folder: config.json and *.safetensors (any float dtype, or compact.py's
        int8; run in fp32)."""
        from safetensors.torch import load_file

        from .compact import expand_state

        folder = Path(folder)
        if not (folder / "config.json").is_file():
            raise SourceError(f"{folder} has no config.json: give a DFlash drafter checkpoint folder")
        config = DFlashConfig.from_dict(json.loads((folder / "config.json").read_text()), str(folder / "config.json"))
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise SourceError(f"{folder} has no .safetensors weights")
        state = {}
        for f in files:
            state.update({k.removeprefix("model."): v for k, v in load_file(str(f)).items()})
        state = expand_state(state)  # the shipped drafters store int8 matrices (compact.py)
        d2t = state.pop("d2t", None)  # a reduced draft vocabulary: draft id -> target id
        state = {k: v.float() for k, v in state.items()}
        drafter = cls(config)
        if d2t is not None:
            if d2t.dim() != 1 or int(d2t.max()) >= config.vocab_size:
                raise SourceError(f"{folder}: d2t must list target token ids below {config.vocab_size}")
            drafter.d2t = d2t.long()
        missing, unexpected = drafter.load_state_dict(state, strict=False)
        if missing:
            raise SourceError(f"{folder}: weights missing for {', '.join(missing[:4])}"
                              f"{' ...' if len(missing) > 4 else ''}")
        if unexpected:
            raise SourceError(f"{folder}: weights this DFlash model does not have: {', '.join(unexpected[:4])} "
                              "(a DFlash-2 or other variant is not supported)")
        return drafter.eval()

    def block_input(self, block_ids, copy_ids, embed):
        """The block rows' input [.., B, H]: the embedded block ids.  A copy-aware drafter also reads,
        on each masked row k, the token prompt lookup would copy there (`copy_ids` [.., B]: the k-th
        token after the latest earlier match of the text's last n-gram, -1 where there is none; row 0,
        the anchor's, is ignored), embedded and projected by copy_proj, and a learned marker of the
        row's kind (0 the anchor, 1 nothing to copy, 2 a copy).  A drafter alone cannot tell what
        repeats (it is right as often where the next token follows an earlier occurrence of the
        anchor as elsewhere); lookup alone is right ~37% of the time: given both, it learns when to copy."""
        c = self.config
        x = torch.nn.functional.embedding(block_ids, embed) * c.embedding_scale
        if not c.copy:
            return x
        masked = torch.arange(block_ids.shape[-1]) > 0
        has = (copy_ids >= 0) & masked
        copied = self.copy_proj(torch.nn.functional.embedding(copy_ids.clamp(min=0), embed))
        return x + self.copy_kind(masked.long() + has.long()) + copied * has.unsqueeze(-1).to(copied.dtype)

    def context(self, features):
        """Tap features [.., N, T*H] -> the fused context rows."""
        return self.hidden_norm(self.fc(features))

    def _heads(self, x, norm, heads):
        s = x.shape[1]
        return norm(x.view(1, s, heads, -1)).view(1, s, -1)

    def layer_step(self, layer, x, ctx, positions, cos, sin, attend):
        """One layer: `attend(q_all, k, v)` runs attention for context+block rows."""
        c, n = self.config, ctx.shape[1]
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = ops.rotary(self._heads(a.q_proj(h), a.q_norm, c.heads), positions[:, n:], cos, sin, c.heads)
        k = torch.cat([a.k_proj(ctx), a.k_proj(h)], dim=1)
        k = ops.rotary(self._heads(k, a.k_norm, c.kv_heads), positions, cos, sin, c.kv_heads)
        v = torch.cat([a.v_proj(ctx), a.v_proj(h)], dim=1)
        q_all = torch.cat([q.new_zeros(1, n, q.shape[-1]), q], dim=1)  # context rows ask nothing
        out = attend(q_all, k, v)
        x = x + a.o_proj(out[:, n:])
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, hidden, lm_head):
        """lm_head [H, V] over the final-normed block rows 1..B-1."""
        c = self.config
        logits = self.norm(hidden[:, 1:]) @ lm_head * c.output_multiplier
        if c.softcap:
            logits = torch.tanh(logits / c.softcap) * c.softcap
        return logits


class Reference:
    """Torch reference of the drafting loop's drafter side, with a growing context cache:
    plain tensors and SDPA-style math, independent of the ONNX graph's cache op."""

    def __init__(self, drafter: DFlashDrafter, embed: torch.Tensor, lm_head: torch.Tensor, max_len: int):
        self.d, self.embed, self.lm_head = drafter, embed, drafter.head(lm_head)
        self.cos, self.sin = drafter.config.rotary_tables(max_len)
        c = drafter.config
        self.keys = [torch.zeros(1, 0, c.kv_heads * c.head_dim) for _ in range(c.layers)]
        self.values = [torch.zeros(1, 0, c.kv_heads * c.head_dim) for _ in range(c.layers)]

    @torch.no_grad()
    def step(self, features: torch.Tensor, block_ids: list[int], start: int,
             copy_ids: list[int] | None = None) -> torch.Tensor:
        """New context rows [N, T*H] (positions start-N..start-1), the block at start.. (and for a
        copy-aware drafter what lookup copies into it, see block_input): logits [B-1, V].  The
        context rows join the cache; the block rows do not."""
        c, n = self.d.config, features.shape[0]
        ctx = self.d.context(features.unsqueeze(0))
        copy_ids = [-1] * len(block_ids) if copy_ids is None else copy_ids
        x = self.d.block_input(torch.tensor([block_ids]), torch.tensor([copy_ids]), self.embed)
        positions = torch.arange(start - n, start + len(block_ids)).unsqueeze(0)
        for i, layer in enumerate(self.d.layers):
            def attend(q_all, k, v, i=i):
                keys, values = torch.cat([self.keys[i], k], dim=1), torch.cat([self.values[i], v], dim=1)
                self.keys[i], self.values[i] = keys[:, : keys.shape[1] - len(block_ids)], values[:, : values.shape[1] - len(block_ids)]
                return _full_attention(q_all, keys, values, c)
            x = self.d.layer_step(layer, x, ctx, positions, self.cos, self.sin, attend)
        return self.d.logits(x, self.lm_head)[0]


def _full_attention(q_all, keys, values, c: DFlashConfig):
    s, t, group = q_all.shape[1], keys.shape[1], c.heads // c.kv_heads
    q = q_all[0].view(s, c.heads, c.head_dim).transpose(0, 1)
    k = keys[0].view(t, c.kv_heads, c.head_dim).transpose(0, 1).repeat_interleave(group, dim=0)
    v = values[0].view(t, c.kv_heads, c.head_dim).transpose(0, 1).repeat_interleave(group, dim=0)
    weights = torch.softmax((q @ k.transpose(1, 2)) * c.head_dim ** -0.5, dim=-1)
    return (weights @ v).transpose(0, 1).reshape(1, s, -1)


class DrafterGraph(torch.nn.Module):
    """Inputs   context [1,N,T*H] (tap features of the N newly committed tokens), block_ids
             [1,B], position_ids [1,N+B] (the context's, then the block's), attention_mask
             [N+B,N+B] bool (all true), past_len [] int64 (context rows cached), for a copy-aware
             drafter copy_ids [1,B] (see DFlashDrafter.block_input), past_key_i / past_value_i [1,Hkv,C,D].
    Outputs  logits [1,B-1,V] (V: the draft vocabulary's size, if reduced); top_logprobs / top_ids [1,B-1,K], the K likeliest tokens per
             position (what the runtime reads); present_key_i / present_value_i (the same
             buffers: rows past_len..past_len+N hold the new context, the B after them are scratch)."""

    TOP_K = 8

    def __init__(self, drafter: DFlashDrafter, embed: torch.Tensor, lm_head: torch.Tensor, capacity: int):
        super().__init__()
        self.d = drafter
        self.register_buffer("embed", embed)
        self.register_buffer("lm_head", drafter.head(lm_head))
        self.register_buffer("d2t", drafter.d2t if drafter.d2t is not None else torch.zeros(0, dtype=torch.long))
        cos, sin = drafter.config.rotary_tables(capacity)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, context, block_ids, position_ids, attention_mask, past_len, *rest):
        c = self.d.config
        copy_ids, caches = (rest[0], rest[1:]) if c.copy else (None, rest)
        ctx = self.d.context(context)
        x = self.d.block_input(block_ids, copy_ids, self.embed)
        presents = []
        for i, layer in enumerate(self.d.layers):
            def attend(q_all, k, v, i=i):
                out, key, value = ops.cached_attention(q_all, k, v, caches[2 * i], caches[2 * i + 1], past_len,
                                                       attention_mask, c.head_dim ** -0.5, c.heads, c.kv_heads)
                presents.extend([key, value])
                return out
            x = self.d.layer_step(layer, x, ctx, position_ids, self.cos, self.sin, attend)
        logits = self.d.logits(x, self.lm_head)
        top_logprobs, top_ids = torch.log_softmax(logits, dim=-1).topk(self.TOP_K, dim=-1)
        if self.d.d2t is not None:
            top_ids = self.d2t[top_ids]  # draft vocabulary ids -> the target's
        return (logits, top_logprobs, top_ids, *presents)


def example_inputs(c: DFlashConfig, capacity: int, n: int = 3, past: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b = c.block_size
    features = torch.randn(1, n, len(c.target_layer_ids) * c.hidden_size, generator=g)
    block = torch.tensor([[int(torch.randint(0, c.vocab_size, (1,), generator=g))] + [c.mask_token_id] * (b - 1)])
    positions = torch.arange(past, past + n + b).unsqueeze(0)
    mask = torch.ones(n + b, n + b, dtype=torch.bool)
    caches = [torch.randn(1, c.kv_heads, capacity, c.head_dim, generator=g) * 0.5 for _ in range(2 * c.layers)]
    # a copy on some rows, none on others (-1)
    copy_ids = [torch.where(torch.arange(b) % 3 == 2, -1, torch.randint(0, c.vocab_size, (b,), generator=g))[None]]
    return (features, block, positions, mask, torch.tensor(past, dtype=torch.int64),
            *(copy_ids if c.copy else []), *caches)


def export_onnx(drafter: DFlashDrafter, embed, lm_head, capacity: int, attention: str, path) -> None:
    c = drafter.config
    graph = DrafterGraph(drafter, embed, lm_head, capacity).eval()
    past = [f"past_{kind}_{i}" for i in range(c.layers) for kind in ("key", "value")]
    present = [f"present_{kind}_{i}" for i in range(c.layers) for kind in ("key", "value")]
    n, rows = torch.export.Dim("N", min=0, max=capacity), torch.export.Dim("R", min=3, max=capacity)
    b = torch.export.Dim("B", min=3, max=64)
    copy = ["copy_ids"] if c.copy else []
    dynamic = {"context": {1: n}, "block_ids": {1: b}, "position_ids": {1: rows},
               "attention_mask": {0: rows, 1: rows}, "past_len": None,
               "rest": ({1: b},) * len(copy) + (None,) * (2 * c.layers)}
    # Size-oblivious: N may be 0 or 1 (no new context rows, or the anchor's alone) without
    # torch.export specializing the graph to larger sizes.
    from torch.fx.experimental import _config as fx_config

    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        exported = torch.export.export(graph, example_inputs(c, capacity), dynamic_shapes=dynamic, strict=False)
        program = torch.onnx.export(
            exported, dynamo=True,
            input_names=["context", "block_ids", "position_ids", "attention_mask", "past_len", *copy, *past],
            output_names=["logits", "top_logprobs", "top_ids", *present],
            custom_translation_table=ops.translation_table(attention),
            opset_version=23 if attention == "onnx" else 20, optimize=True, verbose=False)
    program.save(str(path), external_data=True)


@torch.no_grad()
def reference_generate(target, drafter: DFlashDrafter, ids: list[int], max_new_tokens: int, max_len: int = 512):
    """A plain torch DFlash loop for tests: the HF target recomputed over the whole sequence
    each step (no cache to get wrong), greedy, a full block verified as a chain.
    Returns (new tokens, drafts accepted per step)."""
    c = drafter.config
    embed = target.get_input_embeddings().weight.float()
    reference = Reference(drafter, embed, target.lm_head.weight.float().t(), max_len)

    def run(tokens):
        out = target(torch.tensor([tokens]), output_hidden_states=True)
        features = torch.cat([out.hidden_states[i + 1][0] for i in c.target_layer_ids], dim=-1)
        return out.logits[0], features

    logits, features = run(ids)
    new, accepted, pending = [int(logits[-1].argmax())], [], features
    while len(new) < max_new_tokens:
        committed = ids + new
        start = len(committed) - 1
        copy_ids = None
        if c.copy:
            from dflash.runtime.drafters import lookup_draft

            copied = lookup_draft(committed, c.block_size - 1)[0]
            copy_ids = [-1] + copied + [-1] * (c.block_size - 1 - len(copied))
        drafts = reference.step(pending, [committed[-1]] + [c.mask_token_id] * (c.block_size - 1), start, copy_ids)
        drafts = drafts.argmax(-1)
        drafts = (drafts if drafter.d2t is None else drafter.d2t[drafts]).tolist()
        logits, features = run(committed + drafts)
        choices = logits[start:].argmax(-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == choices[a]:
            a += 1
        new += drafts[:a] + [choices[a]]
        accepted.append(a)
        pending = features[start : start + a + 1]
    return new[:max_new_tokens], accepted
