"""The streaming exporter (export/stream.py): the graph it writes computes what the traced one
does, bit for bit, and its memory grows with the largest tensor, not with the model."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.export import sources
from dflash.export.check import stored_caches
from dflash.export.cli import export_target
from dflash.export.target import example_inputs
from dflash.runtime.bundle import load_bundle
from dflash.runtime.session import make_session

from tiny_models import save_model_folder


def run_graph(bundle: Path, config, seed: int):
    """Every output of the bundle's target graph for random inputs (6 rows after 9 cached)."""
    info = load_bundle(bundle)
    session = make_session(info.graph_path("target"), info, threads=None)
    inputs = example_inputs(config, info.max_len, s=6, past=9, seed=seed)
    caches = stored_caches(inputs[4:], info.kv["dtype"])[0]  # in the bundle's KV format
    return session.run(None, dict(zip([i.name for i in session.get_inputs()],
                                      [t.numpy() for t in inputs[:4]] + caches)))


@pytest.mark.parametrize("arch,dtype,stored,kv", [
    ("llama", "fp32", "float32", "fp32"), ("qwen2", "int4", "float32", "fp32"), ("qwen3", "int4", "bfloat16", "fp32"),
    ("qwen3", "fp32", "float16", "fp32"), ("llama", "int8", "bfloat16", "fp32"), ("llama", "int4", "float32", "int8"),
    ("qwen3", "fp32", "bfloat16", "fp16")])
def test_streamed_graph_gives_the_traced_graphs_outputs(tmp_path, arch, dtype, stored, kv):
    hf = save_model_folder(arch, tmp_path / "hf", layers=3)
    if stored != "float32":  # a half-precision checkpoint, as the hub's are
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(hf, dtype=getattr(torch, stored)).save_pretrained(hf)
    assert sources.streamable(str(hf))
    traced = export_target(str(hf), tmp_path / "traced", dtype, max_len=64, source=sources.load(str(hf)),
                           kv_dtype=kv)
    streamed = export_target(str(hf), tmp_path / "streamed", dtype, max_len=64, kv_dtype=kv)
    assert streamed["kv"]["dtype"] == traced["kv"]["dtype"] == kv
    assert traced["graphs"]["target"]["file"] == streamed["graphs"]["target"]["file"]
    assert traced["graphs"]["target"].get("weights") == streamed["graphs"]["target"].get("weights")
    assert streamed["export_check"]["passed"]
    config = sources.describe(str(hf)).config
    for seed in (1, 2):
        want, got = run_graph(tmp_path / "traced", config, seed), run_graph(tmp_path / "streamed", config, seed)
        assert len(want) == len(got) == 2 + 2 * config.num_hidden_layers
        for a, b in zip(want, got):  # logits, taps and every present cache
            np.testing.assert_array_equal(a, b)


MEASURE = """
import json, sys
from pathlib import Path
import torch, onnxruntime, transformers
from dflash.export.cli import export_target
from dflash.export import stream, blocks  # noqa: F401 (their imports counted in the baseline)
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork and exec
status = lambda key: int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
before = status("VmRSS")
export_target(sys.argv[1], Path(sys.argv[2]), "int4", max_len=256)
print(json.dumps({"before": before, "after": status("VmHWM")}))
"""


def peak_growth(tmp_path: Path, layers: int) -> tuple[int, int, int]:
    """(peak RSS growth of a streamed int4 export, its bundle's bytes, the fp32 model's bytes) for
    a bf16 Llama folder of `layers` layers of one width, in a fresh process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiny_models import make_tokenizer

    config = LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    hf, bundle = tmp_path / f"hf{layers}", tmp_path / f"bundle{layers}"
    model.save_pretrained(hf)
    make_tokenizer().save_pretrained(hf)
    fp32_bytes = 4 * sum(p.numel() for p in model.parameters())
    out = subprocess.run([sys.executable, "-c", MEASURE, str(hf), str(bundle)], capture_output=True, text=True,
                         check=True)
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    return rss["after"] - rss["before"], sum(f.stat().st_size for f in bundle.iterdir()), fp32_bytes


def test_streamed_export_memory_is_bounded_by_the_largest_tensor(tmp_path):
    """Seven times the layers (4 -> 28, +276 MB of fp32 weights, the largest tensor 6 MB): the
    export's peak grows by no more than the int4 bundle the check's ONNX Runtime session holds,
    plus 64 MB. The traced exporter held the model in fp32 several times over (its peak grew by
    1.8 GB exporting a 296 MB model)."""
    small, small_bundle, small_fp32 = peak_growth(tmp_path, 4)
    large, large_bundle, large_fp32 = peak_growth(tmp_path, 28)
    model_growth, bundle_growth = large_fp32 - small_fp32, large_bundle - small_bundle
    assert large - small < bundle_growth + (64 << 20), (
        f"the export's peak grew {(large - small) / 2**20:.0f} MB more for {model_growth / 2**20:.0f} MB more "
        f"of model (the bundle: {bundle_growth / 2**20:.0f} MB more)")
