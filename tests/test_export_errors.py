"""Bad export input gets one clear message, and never leaves a bundle that looks valid."""

import json

import pytest
from click.testing import CliRunner

from dflash.export import cli
from dflash.export.sources import SourceError, load


def run_cli(*args):
    return CliRunner().invoke(cli.main, list(args))


def test_missing_source(tmp_path):
    result = run_cli("target", str(tmp_path / "nowhere"), "--out", str(tmp_path / "b"))
    assert result.exit_code != 0
    assert "does not exist" in result.output and "'default'" in result.output
    assert not (tmp_path / "b").exists()


def test_folder_with_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(SourceError, match="unsupported architecture 'gpt2'.*supported: llama, qwen2, qwen3"):
        load(str(tmp_path))


def test_folder_without_config(tmp_path):
    with pytest.raises(SourceError, match="no config.json"):
        load(str(tmp_path))


def test_gguf_with_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = run_cli("target", str(path), "--out", str(tmp_path / "b"))
    assert result.exit_code != 0 and "unsupported architecture 'gpt2'" in result.output


def test_truncated_gguf(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00")
    with pytest.raises(SourceError, match="not a readable GGUF"):
        load(str(path))


def test_failed_export_leaves_no_bundle(tmp_path, monkeypatch):
    from tiny_models import save_model_folder

    from dflash.export import target

    hf = save_model_folder("llama", tmp_path / "hf")

    def explode(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(target, "export_onnx", explode)
    out = tmp_path / "bundle"
    with pytest.raises(OSError, match="No space left"):
        cli.export_target(str(hf), out, max_len=64)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no .partial folder either


def test_existing_bundle_needs_overwrite(tmp_path):
    (tmp_path / "b").mkdir()
    from tiny_models import save_model_folder

    hf = save_model_folder("llama", tmp_path / "hf")
    result = run_cli("target", str(hf), "--out", str(tmp_path / "b"), "--max-len", "64")
    assert result.exit_code != 0 and "--overwrite" in result.output


def test_bad_taps(tmp_path):
    from tiny_models import save_model_folder

    hf = save_model_folder("llama", tmp_path / "hf")
    result = run_cli("target", str(hf), "--out", str(tmp_path / "b"), "--taps", "1,9")
    assert result.exit_code != 0 and "layer ids must lie in 0..3" in result.output
