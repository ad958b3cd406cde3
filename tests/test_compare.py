"""`dflash-bench compare` on a tiny bundle: our modes, and the peers that run offline on it."""

import importlib.util
import json

from click.testing import CliRunner

PROMPTS = [
    {"id": "a", "kind": "chat", "messages": [{"role": "user", "content": "the quick brown fox"}]},
    {"id": "b", "kind": "grounded", "prompt": "a cache holds keys and values. a cache holds keys and"},
]


def test_compare_tiny(spec_bundle, tmp_path, monkeypatch):
    from dflash.bench import compare as cmp

    # llamacpp: the tiny bundle's source is a HF folder (no GGUF) -> a note; a peer whose
    # package is missing -> a note naming the extra, never an error
    monkeypatch.setitem(cmp.PEER_SETUP, "hf", (("no_such_module_for_dflash",), "transformers"))
    report = cmp.compare([str(spec_bundle())], PROMPTS, "prompts.jsonl", 6, 1, ["llamacpp", "hf", "ortgenai"],
                         tmp_path / "peers", tmp_path / "out.json", None)
    rows = report["rows"]
    assert rows["dflash ar fp32"]["lossless"] and rows["dflash ar fp32"]["base"] == "dflash ar fp32"
    for mode in ("lookup", "self-int8", "draft-lm-tree"):
        row = rows[f"dflash {mode} fp32"]
        assert row["lossless"] is True and row["base"] == "dflash ar fp32"
        assert row["decode_tokens_per_s"] > 0 and set(row["decode_tokens_per_s_by_kind"]) == {"chat", "grounded"}
    notes = " ".join(report["notes"])
    assert "hf: skipped" in notes and "pip install -e '.[compare]'" in notes
    if importlib.util.find_spec("llama_cpp"):
        assert "llamacpp: skipped, the bundle's source is not a GGUF" in notes
    if importlib.util.find_spec("onnxruntime_genai"):  # its builder on the tiny HF folder, then greedy
        for name in ("ortgenai greedy fp32", "ortgenai ngram fp32"):
            assert rows[name]["decode_tokens_per_s"] > 0, notes
        assert "ortgenai greedy int4" not in rows  # built at the precisions of the bundles given only
        assert rows["ortgenai ngram fp32"]["base"] == "ortgenai greedy fp32"
        assert all(len(t) == 6 or t[-1] == 2 for t in rows["ortgenai greedy fp32"]["outputs"].values()), rows["ortgenai greedy fp32"]["outputs"]
    assert json.loads((tmp_path / "out.json").read_text())["rows"].keys() == rows.keys()


def test_compare_hf_peer(tiny, tmp_path):
    import pytest

    pytest.importorskip("transformers")
    from dflash.bench import compare as cmp

    report = cmp.compare([str(tiny("llama")[0])], PROMPTS, "prompts.jsonl", 6, 1, ["hf"], tmp_path, None,
                         tmp_path / "plot.png")
    rows = report["rows"]
    assert rows["transformers prompt-lookup fp32"]["base"] == "transformers greedy fp32"
    assert rows["transformers greedy fp32"]["tokens_per_step"] == 1.0
    assert rows["transformers prompt-lookup fp32"]["lossless"] is not None
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_compare_command_registered():
    from dflash.bench.cli import main

    result = CliRunner().invoke(main, ["compare", "--help"])
    assert result.exit_code == 0 and "--peers" in result.output
