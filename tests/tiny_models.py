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
