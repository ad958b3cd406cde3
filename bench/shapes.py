"""Random-weight Hugging Face folders of the shapes users run (`dflash-bench shapes`).

Speed and memory do not depend on the weights' values, so a folder with a published model's
config.json and random bf16 safetensors (sharded with an index, as the hub's are) measures what
that model would: export time and peak memory, decode and verify cost.  Nothing it says about
quality or acceptance means anything.  The tokenizer is the default model's (SmolLM2's): ids past
its vocabulary decode to nothing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, head_dim=128,
             num_key_value_heads=8, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
             hidden_act="silu", attention_bias=False, bos_token_id=151643, eos_token_id=151645)
LLAMA3 = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, num_key_value_heads=8,
              rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072, hidden_act="silu",
              attention_bias=False, mlp_bias=False, bos_token_id=128000, eos_token_id=128009,
              rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192})
# The published configs' shapes (hidden, layers, heads, intermediate, tied embeddings).
SHAPES = {
    "qwen3-0.6b": {**QWEN3, "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "intermediate_size": 3072, "tie_word_embeddings": True},
    "qwen3-1.7b": {**QWEN3, "hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "intermediate_size": 6144, "tie_word_embeddings": True},
    "qwen3-4b": {**QWEN3, "hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "intermediate_size": 9728, "tie_word_embeddings": True},
    "qwen3-8b": {**QWEN3, "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "intermediate_size": 12288, "tie_word_embeddings": False},
    "llama-3.2-1b": {**LLAMA3, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                     "head_dim": 64, "intermediate_size": 8192, "tie_word_embeddings": True},
    "llama-3.2-3b": {**LLAMA3, "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,
                     "head_dim": 128, "intermediate_size": 8192, "tie_word_embeddings": True},
    "llama-3.1-8b": {**LLAMA3, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "head_dim": 128, "intermediate_size": 14336, "tie_word_embeddings": False},
}
# Published drafters' shapes for those targets: z-lab's DFlash drafters (5 Qwen3 layers of the
# target's width, block 16, five taps) and an EAGLE-3 head (reference layout, 32k draft vocabulary).
DRAFTERS = {
    "qwen3-4b-dflash-b16": {"kind": "dflash", "target": "qwen3-4b", "layers": 5, "taps": [1, 9, 17, 25, 33]},
    "qwen3-8b-dflash-b16": {"kind": "dflash", "target": "qwen3-8b", "layers": 5, "taps": [1, 9, 17, 25, 33]},
    "llama-3.1-8b-eagle3": {"kind": "eagle3", "target": "llama-3.1-8b", "taps": [1, 15, 28], "draft_vocab": 32000},
}
SHARD_BYTES = 2 << 30
STD = 0.02  # the weights' spread: the published models' initializer range


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every weight of a Llama-family checkpoint with this config, by its checkpoint name."""
    h, d = config["hidden_size"], config["head_dim"]
    q, kv, inter = config["num_attention_heads"] * d, config["num_key_value_heads"] * d, config["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)})
        if config["model_type"] == "qwen3":
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    shapes["model.norm.weight"] = (h,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    return shapes


def random_tensor(name: str, shape, seed: int):
    import torch

    if len(shape) == 1:  # norms: ones, as initialised (random scales would only blow up activations)
        return torch.ones(shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * STD).to(torch.bfloat16)


def write_folder(shape: str, out: Path, seed: int = 0, progress=print) -> Path:
    """A folder of the named shape: config.json, generation_config.json, the default model's
    tokenizer, random bf16 weights in shards of up to 2 GB with model.safetensors.index.json."""
    from safetensors.torch import save_file

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    config = {**SHAPES[shape], "torch_dtype": "bfloat16", "initializer_range": STD}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}))
    write_tokenizer(out)
    shapes = tensor_shapes(config)
    total = sum(2 * _numel(s) for s in shapes.values())
    shards, current, size, done, start = [], {}, 0, 0, time.perf_counter()
    for j, (name, dims) in enumerate(shapes.items()):
        current[name] = random_tensor(name, dims, seed * 100003 + j)
        size += 2 * _numel(dims)
        if size >= SHARD_BYTES or j == len(shapes) - 1:
            shards.append(current)
            file = out / f"model-{len(shards):05d}.safetensors"
            save_file(current, str(file), metadata={"format": "pt"})
            done += size
            elapsed = time.perf_counter() - start
            progress(f"  {file.name}: {done / 2**30:.1f} of {total / 2**30:.1f} GiB ({elapsed:.0f}s, "
                     f"about {elapsed / done * (total - done):.0f}s to go)")
            shards[-1] = {k: file.name for k in current}
            current, size = {}, 0
    weight_map = {k: v for shard in shards for k, v in shard.items()}
    files = sorted(set(weight_map.values()))
    names = {f: f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i, f in enumerate(files)}
    for old, new in names.items():
        (out / old).rename(out / new)
    index = {"metadata": {"total_size": total}, "weight_map": {k: names[v] for k, v in weight_map.items()}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


def drafter_tensors(spec: dict, t: dict) -> tuple[dict, dict]:
    """(config.json, tensor shapes) of the drafter `spec` for the target config `t`."""
    h, d, inter = t["hidden_size"], t["head_dim"], t["intermediate_size"]
    q, kv = t["num_attention_heads"] * d, t["num_key_value_heads"] * d
    layer = {"self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
             "mlp.down_proj.weight": (h, inter), "input_layernorm.weight": (h,),
             "post_attention_layernorm.weight": (h,)}
    common = {k: t[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                "intermediate_size", "rms_norm_eps", "rope_theta", "vocab_size", "hidden_act")}
    if spec["kind"] == "dflash":
        config = {**common, "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
                  "num_hidden_layers": spec["layers"], "max_position_embeddings": 40960, "block_size": 16,
                  "num_target_layers": t["num_hidden_layers"], "attention_bias": False, "tie_word_embeddings": False,
                  "torch_dtype": "bfloat16",
                  "dflash_config": {"mask_token_id": t["vocab_size"] - 1, "target_layer_ids": spec["taps"]}}
        shapes = {"fc.weight": (h, len(spec["taps"]) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
        for i in range(spec["layers"]):
            shapes.update({f"layers.{i}.{k}": v for k, v in {
                **layer, "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                "self_attn.v_proj.weight": (kv, h), "self_attn.q_norm.weight": (d,),
                "self_attn.k_norm.weight": (d,)}.items()})
        return config, shapes
    vd = spec["draft_vocab"]
    config = {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
              "max_position_embeddings": 2048, "draft_vocab_size": vd, "torch_dtype": "bfloat16",
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": spec["taps"]}}
    shapes = {f"midlayer.{k}": v for k, v in {
        **layer, "hidden_norm.weight": (h,), "self_attn.q_proj.weight": (q, 2 * h),
        "self_attn.k_proj.weight": (kv, 2 * h), "self_attn.v_proj.weight": (kv, 2 * h)}.items()}
    shapes.update({"fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (vd, h)})
    return config, shapes


def write_drafter(name: str, out: Path, seed: int = 0) -> Path:
    """A random drafter of a published shape (DRAFTERS) in its checkpoint layout, one bf16 file."""
    import torch
    from safetensors.torch import save_file

    spec = DRAFTERS[name]
    config, shapes = drafter_tensors(spec, SHAPES[spec["target"]])
    state = {k: random_tensor(k, v, seed * 100003 + j) for j, (k, v) in enumerate(shapes.items())}
    if spec["kind"] == "eagle3":  # draft id i scores target id 2i (d2t: the offset), every other target id
        vd, vocab = spec["draft_vocab"], config["vocab_size"]
        state["d2t"] = torch.arange(0, 2 * vd, 2) - torch.arange(vd)
        state["t2d"] = torch.zeros(vocab, dtype=torch.bool)
        state["t2d"][0:2 * vd:2] = True
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def write_tokenizer(out: Path) -> None:
    from transformers import AutoTokenizer

    from dflash.export.sources import default_gguf_path

    path = default_gguf_path()
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(out)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
