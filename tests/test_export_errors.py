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

    from dflash.export import sources, stream, target

    hf = save_model_folder("llama", tmp_path / "hf")

    def explode(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(target, "export_onnx", explode)  # the traced export
    monkeypatch.setattr(stream.StreamExport, "save", explode)  # the streamed one, its data file written
    out = tmp_path / "bundle"
    for source in (None, sources.load(str(hf))):  # streamed, traced
        with pytest.raises(OSError, match="No space left"):
            cli.export_target(str(hf), out, max_len=64, source=source)
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


# ------------------------------------------------------------------------------------------------
# faults: unreadable weights, missing weights, a disk that fills up


def test_gguf_with_unsupported_tensor_type(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    # Q8_K (llama.cpp's intermediate type) has no dequantizer: 4 rows of one 292-byte block each
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 292), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = run_cli("target", str(path), "--out", str(tmp_path / "b"))
    assert result.exit_code != 0
    assert "tensor 'blk.0.attn_q.weight' is stored as Q8_K" in result.output
    assert "Q8_0" in result.output and "llama-quantize" in result.output  # the fix
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("fault", ["no weight files", "a tensor missing"])
def test_folder_with_missing_weights(tmp_path, fault):
    from safetensors.torch import load_file, save_file
    from tiny_models import save_model_folder

    hf = save_model_folder("llama", tmp_path / "hf")
    weights = hf / "model.safetensors"
    if fault == "no weight files":
        weights.unlink()
        message = "has a config.json but no weights"
    else:  # transformers would silently fill the missing tensor with random values
        state = load_file(str(weights))
        del state["model.layers.2.mlp.up_proj.weight"]
        save_file(state, str(weights), metadata={"format": "pt"})
        message = "lacks 1 of the model's weights (model.layers.2.mlp.up_proj.weight)"
    result = run_cli("target", str(hf), "--out", str(tmp_path / "b"), "--max-len", "64")
    assert result.exit_code != 0 and message in result.output, result.output
    assert "weight files" in result.output  # the fix
    assert not (tmp_path / "b").exists()


def bundles_in(folder):
    return sorted(str(p.parent.relative_to(folder)) for p in folder.rglob("dflash.json"))


@pytest.mark.parametrize("when", ["writing the graph", "writing the graph (numpy)", "writing the manifest"])
def test_disk_full_mid_export(tmp_path, monkeypatch, when):
    """The disk fills up part way: one clear message naming the disk and the folder; no
    partial folder left, and an existing bundle being overwritten is left as it was."""
    import errno

    from tiny_models import save_model_folder

    from dflash.export import bundle, stream, target

    hf = save_model_folder("llama", tmp_path / "hf")
    out = tmp_path / "bundle"
    out.mkdir()
    (out / "dflash.json").write_text('{"old": true}')  # the bundle --overwrite would replace

    def no_space(*args, **kwargs):
        if when.endswith("(numpy)"):  # numpy's tofile, with which the ONNX exporter saves weights: no errno
            raise OSError("Not enough free space to write 99614720 bytes after offset 5064229376")
        raise OSError(errno.ENOSPC, "No space left on device")

    if when.startswith("writing the graph"):
        def partial_graph(model, taps, max_len, attention, path, batched=False):
            path.write_bytes(b"onnx")
            path.with_name(path.name + ".data").write_bytes(b"\0" * 100_000)
            no_space()
        monkeypatch.setattr(target, "export_onnx", partial_graph)  # the traced export

        def partial_data(self, data):  # the streamed export: the first bytes land, then the disk is full
            self.file.write(b"\0" * 100_000)
            no_space()
        monkeypatch.setattr(stream.DataFile, "write", partial_data)
    else:  # graph and tokenizer written, then the manifest fails
        monkeypatch.setattr(bundle, "write_manifest", no_space)
    result = run_cli("target", str(hf), "--out", str(out), "--max-len", "64", "--overwrite")
    assert result.exit_code != 0
    assert "the disk is full: no space left on the device" in result.output, result.output
    assert str(out.resolve()) in result.output and "free up disk space" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "hf"]  # no .bundle.partial
    assert bundles_in(tmp_path) == ["bundle"] and (out / "dflash.json").read_text() == '{"old": true}'
