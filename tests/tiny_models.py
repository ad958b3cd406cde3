"""Tiny random-weight models and a small tokenizer, saved as Hugging Face folders."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = ("the quick brown fox jumps over the lazy dog. speculative decoding drafts tokens and the "
        "target verifies them all at once. a cache holds keys and values for every layer. ") * 20


def make_tokenizer(vocab_size: int = 160):
    """A byte-level BPE tokenizer trained on a paragraph: real merges, multi-byte pieces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model(arch: str, vocab_size: int, layers: int = 4, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    kinds = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
             "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_cls, model_cls = kinds[arch]
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    config = config_cls(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        tie_word_embeddings=(arch != "llama"), eos_token_id=2, bos_token_id=0,
                        # large random weights: outputs that depend on the context, not one repeated token
                        initializer_range=0.2, **extra)
    torch.manual_seed(seed)
    return model_cls(config).eval()


def save_model_folder(arch: str, folder: Path, layers: int = 4, seed: int = 0, vocab_size: int = 160) -> Path:
    tokenizer = make_tokenizer(vocab_size)
    model = make_model(arch, len(tokenizer), layers, seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_dflash_folder(folder: Path, hidden_size: int, target_layers: int, taps: list[int], vocab_size: int,
                       mask_token_id: int, block_size: int = 16, layers: int = 1, heads: int = 4,
                       kv_heads: int = 2, head_dim: int = 16, seed: int = 0, std: float = 0.2,
                       copy: bool = False) -> Path:
    """A random DFlash drafter in z-lab's checkpoint layout: config.json + model.safetensors (bf16);
    `copy`: a copy-aware one (dflash-train fit --copy)."""
    import json

    import torch
    from safetensors.torch import save_file

    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden_size,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "intermediate_size": 2 * hidden_size, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 4096, "vocab_size": vocab_size,
        "block_size": block_size, "num_target_layers": target_layers, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": taps, **({"copy": True} if copy else {})},
    }
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    def norm(n):
        return (1 + torch.randn(n, generator=g) * 0.1).to(torch.bfloat16)

    q, kv, inter = heads * head_dim, kv_heads * head_dim, 2 * hidden_size
    state = {"fc.weight": w(hidden_size, len(taps) * hidden_size) / len(taps) ** 0.5,
             "hidden_norm.weight": norm(hidden_size), "norm.weight": norm(hidden_size)}
    for i in range(layers):
        p = f"layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": w(q, hidden_size), p + "self_attn.k_proj.weight": w(kv, hidden_size),
            p + "self_attn.v_proj.weight": w(kv, hidden_size), p + "self_attn.o_proj.weight": w(hidden_size, q),
            p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden_size), p + "mlp.up_proj.weight": w(inter, hidden_size),
            p + "mlp.down_proj.weight": w(hidden_size, inter),
            p + "input_layernorm.weight": norm(hidden_size), p + "post_attention_layernorm.weight": norm(hidden_size),
        })
    if copy:
        state.update({"copy_proj.weight": w(hidden_size, hidden_size), "copy_kind.weight": w(3, hidden_size)})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def save_eagle3_folder(folder: Path, hidden_size: int, vocab_size: int, layout: str = "reference",
                       aux_ids: list[int] | None = None, draft_vocab: int | None = None, heads: int = 4,
                       kv_heads: int = 2, head_dim: int = 16, seed: int = 0, std: float = 0.2) -> Path:
    """A random EAGLE-3 head: the reference layout (`midlayer.*`, a plain Llama config plus
    draft_vocab_size) or the speculators one (`layers.0.*`, a nested transformer_layer_config).
    With `draft_vocab`, the head scores that many target ids (every other one) through d2t."""
    import json

    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * std

    def norm(n):
        return 1 + torch.randn(n, generator=g) * 0.1

    h, q, kv, inter = hidden_size, heads * head_dim, kv_heads * head_dim, 2 * hidden_size
    vd = draft_vocab or vocab_size
    layer = {"input_layernorm.weight": norm(h), "hidden_norm.weight": norm(h),
             "post_attention_layernorm.weight": norm(h),
             "self_attn.q_proj.weight": w(q, 2 * h), "self_attn.k_proj.weight": w(kv, 2 * h),
             "self_attn.v_proj.weight": w(kv, 2 * h), "self_attn.o_proj.weight": w(h, q),
             "mlp.gate_proj.weight": w(inter, h), "mlp.up_proj.weight": w(inter, h),
             "mlp.down_proj.weight": w(h, inter)}
    prefix = "midlayer." if layout == "reference" else "layers.0."
    state = {prefix + k: v for k, v in layer.items()}
    state.update({"fc.weight": w(h, 3 * h) / 3 ** 0.5, "norm.weight": norm(h), "lm_head.weight": w(vd, h)})
    if draft_vocab:
        targets = torch.arange(0, 2 * draft_vocab, 2)
        state["d2t"] = targets - torch.arange(draft_vocab)  # target id = draft id + d2t[draft id]
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[targets] = True
        state["t2d"] = t2d
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
             "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": inter,
             "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
             "vocab_size": vocab_size, "num_hidden_layers": 1, "hidden_act": "silu"}
    if layout == "reference":
        config = {**llama, "draft_vocab_size": vd}
        if aux_ids:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids}
    else:
        config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                  "transformer_layer_config": llama, "draft_vocab_size": vd, "norm_before_residual": False}
        if aux_ids:
            config["eagle_aux_hidden_state_layer_ids"] = aux_ids
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder
