"""EAGLE-3 draft heads: the checkpoint (the reference layout of SafeAILab/EAGLE and the
speculators layout), a torch reference of one draft step, and the ONNX drafter graph.

One step takes R new rows. A row pairs a feature with the token at the NEXT position: the
target's three tap states of position j (fused by `fc` from 3*Ht to H) or, while drafting, the
head's own output state of the row it extends (already H wide), with the token at j+1.
  x   = [input_layernorm(embed(token)), hidden_norm(h)]        (2H: embedding first)
  out = one Llama layer over x, its residual h (hidden_norm(h) with norm_before_residual)
  logits = lm_head(norm(out)) over the draft vocabulary; target id = draft id + d2t[draft id]
The pre-norm `out` is the feature of the next step's row. The layer attends to the head's own
KV cache (committed rows) and to the new rows through a tree mask, like the DFlash drafter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import ops
from .dflash import MLP, RMSNorm, _linear
from .sources import SourceError


@dataclass
class Eagle3Config:
    hidden_size: int
    target_hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float
    vocab_size: int          # the target's
    draft_vocab_size: int
    taps: list[int]          # target layers whose OUTPUTS the head reads (this project's convention)
    rope_theta: float = 10000.0
    norm_before_residual: bool = False
    layout: str = "reference"
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, d: dict, state: dict, target_layers: int, where: str = "config.json") -> "Eagle3Config":
        """Either layout's config.json; head_dim and kv heads come from the weights (the reference
        ignores config.head_dim). `target_layers` resolves the default taps."""
        layout = "speculators" if "transformer_layer_config" in d else "reference"
        layer = d.get("transformer_layer_config", d)

        def get(key, default=None):
            value = layer.get(key, d.get(key, default))
            if value is None:
                raise SourceError(f"{where} lacks {key!r}, which an EAGLE-3 head needs")
            return value

        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        if "q_proj.weight" not in state or "k_proj.weight" not in state:
            raise SourceError(f"{where}: the weights have no midlayer.self_attn (or layers.0.self_attn) "
                              "q_proj/k_proj: not an EAGLE-3 head")
        q_rows, k_rows = state["q_proj.weight"].shape[0], state["k_proj.weight"].shape[0]
        head_dim = q_rows // heads
        aux = d.get("eagle_aux_hidden_state_layer_ids") or (d.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids")
        return cls(hidden_size=hidden, target_hidden_size=int(d.get("target_hidden_size") or hidden), heads=heads,
                   kv_heads=k_rows // head_dim, head_dim=head_dim, intermediate_size=int(get("intermediate_size")),
                   eps=float(get("rms_norm_eps", 1e-6)), vocab_size=int(get("vocab_size")),
                   draft_vocab_size=int(d.get("draft_vocab_size") or get("vocab_size")),
                   taps=tap_layers(aux, target_layers), rope_theta=float(layer.get("rope_theta") or 10000.0),
                   norm_before_residual=bool(d.get("norm_before_residual", False)), layout=layout, raw=d)

    def rotary_tables(self, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [max_len, D/2] for the head's rope_theta (and rope_scaling, if any)."""
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        layer = self.raw.get("transformer_layer_config", self.raw)
        config = LlamaConfig(hidden_size=self.heads * self.head_dim, num_attention_heads=self.heads,
                             head_dim=self.head_dim, rope_theta=self.rope_theta,
                             rope_scaling=layer.get("rope_scaling"),
                             max_position_embeddings=layer.get("max_position_embeddings", 2048))
        cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(max_len).unsqueeze(0))
        half = cos.shape[-1] // 2
        return cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()


def tap_layers(aux_ids, target_layers: int) -> list[int]:
    """The target layers (by their outputs) an EAGLE-3 head reads. Default: the residual stream
    entering layers 2, N//2 and N-3, i.e. the outputs of layers 1, N//2-1 and N-4. Explicit ids
    come in two conventions: a list starting at 1 names layer outputs (`hidden_states[id+1]`); one
    starting at 2 or later names layer inputs (`hidden_states[id]`, the output of id-1). Reading
    one convention as the other silently costs most of the acceptance."""
    if not aux_ids:
        return [1, target_layers // 2 - 1, target_layers - 4]
    ids = [int(i) for i in aux_ids]
    return ids if min(ids) <= 1 else [i - 1 for i in ids]


class Eagle3Head(torch.nn.Module):
    """The head's weights under the reference names (fc, midlayer.*, norm, lm_head)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.config = c
        h = c.hidden_size
        self.fc = _linear(3 * c.target_hidden_size, h)
        self.hidden_norm, self.input_layernorm = RMSNorm(h, c.eps), RMSNorm(h, c.eps)
        self.q_proj = _linear(2 * h, c.heads * c.head_dim)
        self.k_proj = _linear(2 * h, c.kv_heads * c.head_dim)
        self.v_proj = _linear(2 * h, c.kv_heads * c.head_dim)
        self.o_proj = _linear(c.heads * c.head_dim, h)
        self.post_attention_layernorm = RMSNorm(h, c.eps)
        self.mlp = MLP(_MLPSize(h, c.intermediate_size))
        self.norm = RMSNorm(h, c.eps)
        self.lm_head = _linear(h, c.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))

    @classmethod
    def load(cls, folder, target_layers: int) -> "Eagle3Head":
        """A head folder: config.json and model.safetensors or pytorch_model.bin, in either layout."""
        folder = Path(folder)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise SourceError(f"{folder} has no config.json: give an EAGLE-3 head folder")
        raw = json.loads(config_file.read_text())
        state = read_state(folder)
        config = Eagle3Config.from_dict(raw, state, target_layers, str(config_file))
        d2t = state.pop("d2t", None)
        state.pop("t2d", None)
        state.pop("embed_tokens.weight", None)  # a head's own copy of the target's embedding: the target's is used
        head = cls(config)
        if d2t is not None:
            state["d2t"] = d2t.long()
        elif config.draft_vocab_size != config.vocab_size:
            raise SourceError(f"{folder}: draft_vocab_size {config.draft_vocab_size} is smaller than the vocabulary "
                              f"{config.vocab_size} but the weights have no d2t table to map draft ids")
        state = {k: (v if k == "d2t" else v.float()) for k, v in state.items()}
        expected = head.state_dict()
        problems = [f"no {k}" for k in expected if k not in state and k != "d2t"]
        problems += [f"{k} is not one of its weights" for k in state if k not in expected]
        problems += [f"{k} is {list(v.shape)}, expected {list(expected[k].shape)}" for k, v in state.items()
                     if k in expected and v.shape != expected[k].shape]
        if problems:
            raise SourceError(f"{folder}: not an EAGLE-3 head this loader reads ({'; '.join(problems[:3])})")
        head.load_state_dict(state, strict=False)
        return head.eval()

    def fuse(self, features):
        """Target tap states [.., 3*Ht] -> the head's width H."""
        return self.fc(features)

    def step(self, h, tokens_embedded, positions, cos, sin, attend):
        """h [1,R,H] (fused target features or the head's own states), the rows' embedded
        tokens [1,R,H]; `attend(q, k, v)` does the cached attention. Returns the pre-norm out."""
        c = self.config
        x = torch.cat([self.input_layernorm(tokens_embedded), self.hidden_norm(h)], dim=-1)
        q = ops.rotary(self.q_proj(x), positions, cos, sin, c.heads)
        k = ops.rotary(self.k_proj(x), positions, cos, sin, c.kv_heads)
        residual = self.hidden_norm(h) if c.norm_before_residual else h
        out = residual + self.o_proj(attend(q, k, self.v_proj(x)))
        return out + self.mlp(self.post_attention_layernorm(out))

    def logits(self, out):
        return self.lm_head(self.norm(out))

    def target_ids(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]


@dataclass
class _MLPSize:  # what dflash.MLP reads of a config
    hidden_size: int
    intermediate_size: int


def read_state(folder: Path) -> dict:
    """Every tensor of the folder under the layer's own names: the prefixes `model.`, `midlayer.`
    (reference layout), `layers.0.` (speculators layout) and `self_attn.` are dropped."""
    files = sorted(folder.glob("*.safetensors"))
    state = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            state.update(load_file(str(f)))
    elif (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise SourceError(f"{folder} has no model.safetensors or pytorch_model.bin")
    renamed = {}
    for name, tensor in state.items():
        name = name.removeprefix("model.")
        for prefix in ("midlayer.", "layers.0.", "self_attn."):
            name = name.removeprefix(prefix)
        renamed[name] = tensor
    return renamed


def _attention(q, keys, values, c: Eagle3Config, visible):
    """Plain softmax attention of q [1,S,H*D] over keys/values [1,T,Hkv*D] (for the reference)."""
    s, t, group = q.shape[1], keys.shape[1], c.heads // c.kv_heads
    qh = q[0].view(s, c.heads, c.head_dim).transpose(0, 1)
    k = keys[0].view(t, c.kv_heads, c.head_dim).transpose(0, 1).repeat_interleave(group, dim=0)
    v = values[0].view(t, c.kv_heads, c.head_dim).transpose(0, 1).repeat_interleave(group, dim=0)
    scores = (qh @ k.transpose(1, 2)) * c.head_dim ** -0.5
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return (weights @ v).transpose(0, 1).reshape(1, s, -1)


class Reference:
    """Torch reference of the head with a plain growing cache (no cache op): `step` runs new
    rows; `keep(n)` keeps the first n cached rows (what the runtime does after a verify)."""

    def __init__(self, head: Eagle3Head, embed: torch.Tensor, max_len: int):
        self.head, self.embed = head, embed
        self.cos, self.sin = head.config.rotary_tables(max_len)
        c = head.config
        self.keys = torch.zeros(1, 0, c.kv_heads * c.head_dim)
        self.values = torch.zeros(1, 0, c.kv_heads * c.head_dim)

    @torch.no_grad()
    def step(self, features, states, tokens: list[int], positions: list[int], mask=None):
        """features [N,3Ht] (target rows) and states [M,H] (own rows) with their tokens and
        positions: (logits [R,Vd], out [R,H]). The rows join the cache."""
        h = torch.cat([self.head.fuse(features.unsqueeze(0)), states.unsqueeze(0)], dim=1)
        r, past = h.shape[1], self.keys.shape[1]
        mask = torch.tril(torch.ones(r, r, dtype=torch.bool)) if mask is None else mask
        visible = torch.cat([torch.ones(r, past, dtype=torch.bool), mask], dim=1)

        def attend(q, k, v):
            self.keys, self.values = torch.cat([self.keys, k], dim=1), torch.cat([self.values, v], dim=1)
            return _attention(q, self.keys, self.values, self.head.config, visible)

        pos = torch.tensor([positions])
        out = self.head.step(h, self.embed[torch.tensor([tokens])], pos, self.cos, self.sin, attend)
        return self.head.logits(out)[0], out[0]

    def keep(self, rows: int) -> None:
        self.keys, self.values = self.keys[:, :rows], self.values[:, :rows]


class DrafterGraph(torch.nn.Module):
    """Inputs   features [1,N,3*Ht] (target tap states), states [1,M,H] (the head's own), token_ids
             [1,N+M] and position_ids [1,N+M] of those rows (target rows first), attention_mask
             [N+M,N+M] bool (the tree among the new rows; cached rows are all visible), past_len []
             int64, past_key_0 / past_value_0 [1,Hkv,C,D].
    Outputs  top_logprobs / top_ids [1,R,K] (target token ids), hidden [1,R,H] (each row's state
             for the next step), logits [1,R,Vd], present_key_0 / present_value_0 (the same buffers,
             rows past_len..past_len+R written)."""

    TOP_K = 8

    def __init__(self, head: Eagle3Head, embed: torch.Tensor, capacity: int):
        super().__init__()
        self.head = head
        self.register_buffer("embed", embed)
        cos, sin = head.config.rotary_tables(capacity)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, features, states, token_ids, position_ids, attention_mask, past_len, key_cache, value_cache):
        c = self.head.config
        h = torch.cat([self.head.fuse(features), states], dim=1)
        presents = []

        def attend(q, k, v):
            out, key, value = ops.cached_attention(q, k, v, key_cache, value_cache, past_len, attention_mask,
                                                   c.head_dim ** -0.5, c.heads, c.kv_heads)
            presents.extend([key, value])
            return out

        embedded = torch.nn.functional.embedding(token_ids, self.embed)
        out = self.head.step(h, embedded, position_ids, self.cos, self.sin, attend)
        logits = self.head.logits(out)
        top_logprobs, top = torch.log_softmax(logits, dim=-1).topk(self.TOP_K, dim=-1)
        return (top_logprobs, self.head.target_ids(top), out, logits, *presents)


def example_inputs(c: Eagle3Config, capacity: int, n: int = 3, m: int = 2, past: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = n + m
    return (torch.randn(1, n, 3 * c.target_hidden_size, generator=g), torch.randn(1, m, c.hidden_size, generator=g),
            torch.randint(0, c.vocab_size, (1, r), generator=g), torch.arange(past, past + r).unsqueeze(0),
            torch.tril(torch.ones(r, r, dtype=torch.bool)), torch.tensor(past, dtype=torch.int64),
            *(torch.randn(1, c.kv_heads, capacity, c.head_dim, generator=g) * 0.5 for _ in range(2)))


INPUTS = ["features", "states", "token_ids", "position_ids", "attention_mask", "past_len", "past_key_0",
          "past_value_0"]
OUTPUTS = ["top_logprobs", "top_ids", "hidden", "logits", "present_key_0", "present_value_0"]


def export_onnx(head: Eagle3Head, embed, capacity: int, attention: str, path) -> None:
    graph = DrafterGraph(head, embed, capacity).eval()
    n, m = torch.export.Dim("N", min=0, max=capacity), torch.export.Dim("M", min=0, max=capacity)
    rows = torch.export.Dim("R", min=1, max=capacity)
    dynamic = {"features": {1: n}, "states": {1: m}, "token_ids": {1: rows}, "position_ids": {1: rows},
               "attention_mask": {0: rows, 1: rows}, "past_len": None, "key_cache": None, "value_cache": None}
    from torch.fx.experimental import _config as fx_config

    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        exported = torch.export.export(graph, example_inputs(head.config, capacity), dynamic_shapes=dynamic,
                                       strict=False)
        program = torch.onnx.export(exported, dynamo=True, input_names=INPUTS, output_names=OUTPUTS,
                                    custom_translation_table=ops.translation_table(attention),
                                    opset_version=23 if attention == "onnx" else 20, optimize=True, verbose=False)
    program.save(str(path), external_data=True)


def is_eagle3(folder: Path) -> bool:
    """Whether a folder holds an EAGLE-3 head (either layout) rather than a DFlash drafter."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return config.get("speculators_model_type") == "eagle3" or (
        "draft_vocab_size" in config and "dflash_config" not in config)
