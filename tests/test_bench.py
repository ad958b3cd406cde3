"""`dflash-bench generate` and `verify` on tiny bundles, and the shipped benchmark prompts."""

import json
from collections import Counter

from click.testing import CliRunner

from dflash.bench.cli import main


def test_benchmark_prompts_are_shipped_by_kind():
    from dflash.bench.prompts import BENCHMARK, QUALITY_TEXT, load_prompts

    rows = load_prompts(BENCHMARK)
    kinds = Counter(row["kind"] for row in rows)
    assert len(rows) >= 24 and len({row["id"] for row in rows}) == len(rows)
    assert set(kinds) == {"chat", "code", "math", "grounded", "list", "rewrite"} and min(kinds.values()) >= 4
    assert all(row["messages"][0]["role"] == "user" and row["messages"][0]["content"] for row in rows)
    assert len(QUALITY_TEXT.read_text().split()) > 1000


def test_generate_compares_modes_with_ar(spec_bundle, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(row) for row in [
        {"id": "a", "kind": "chat", "messages": [{"role": "user", "content": "the quick brown fox"}]},
        {"id": "b", "kind": "grounded", "prompt": "a cache holds keys and values. a cache holds keys and"}]))
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, ["generate", "--bundle", str(spec_bundle()), "--prompts", str(prompts),
                                       "--modes", "ar,lookup,self-int8,no-such-drafter", "--max-new-tokens", "6",
                                       "--threads", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert list(report["modes"]) == ["ar", "lookup", "self-int8"] and all(report["lossless"].values())
    assert report["speedup"]["ar"] == 1.0 and set(report["speedup_by_kind"]["lookup"]) == {"all", "chat", "grounded"}
    assert report["skipped"][0].startswith("no-such-drafter") and report["prompts"] == str(prompts)


def test_generate_samples_with_one_seed_across_modes(spec_bundle, tmp_path):
    """Sampled, every mode draws what `ar` draws with the same seed (sample-and-match), and
    another seed draws something else; transformers' greedy generate cannot join."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "kind": "chat", "prompt": "the quick brown fox"}))
    outputs = []
    for seed in ("1", "2"):
        out = tmp_path / f"bench{seed}.json"
        result = CliRunner().invoke(main, ["generate", "--bundle", str(spec_bundle()), "--prompts", str(prompts),
                                           "--modes", "ar,self-int8", "--max-new-tokens", "12", "--threads", "1",
                                           "--temperature", "1.5", "--top-p", "0.95", "--seed", seed,
                                           "--json", str(out)])
        assert result.exit_code == 0, result.output
        report = json.loads(out.read_text())
        assert report["sampling"] == {"temperature": 1.5, "top_p": 0.95, "top_k": 0, "seed": int(seed)}
        assert all(report["lossless"].values())
        outputs.append(report["modes"]["ar"]["outputs"]["a"])
    assert outputs[0] != outputs[1]
    result = CliRunner().invoke(main, ["generate", "--bundle", str(spec_bundle()), "--prompts", str(prompts),
                                       "--hf", "--temperature", "0.7"])
    assert result.exit_code != 0 and "drop --hf or --temperature" in result.output


def test_verify_times_every_fitting_configuration(tiny, tmp_path):
    out = tmp_path / "verify.json"
    short, long = tiny("llama")[0], tiny("llama", max_len=2048 + 32)[0]
    result = CliRunner().invoke(main, ["verify", "--bundle", str(short), "--bundle", str(long), "--repeats", "1",
                                       "--threads", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    # the 128-row bundle fits no configuration (past 256 or 2048): left out, no error
    assert len(rows) == 12 and all(r["ms"] > 0 for r in rows) and "ms per forward" in result.output


def test_verify_times_each_forced_kernel_path(tiny, tmp_path):
    from dflash.ops import native_kernel_path

    out = tmp_path / "verify.json"
    bundle = tiny("llama", max_len=2048 + 32, dtype="int4")[0]
    result = CliRunner().invoke(main, ["verify", "--bundle", str(bundle), "--paths", "native,portable", "--repeats", "1",
                                       "--threads", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert {r["kernels"] for r in report["rows"]} == {native_kernel_path(), "portable"} and len(report["rows"]) == 24
    assert report["machine"]["kernels"] == native_kernel_path() and "T(8)/T(1) past 256" in result.output
    refused = CliRunner().invoke(main, ["verify", "--bundle", str(bundle), "--paths", "sse9"])
    assert refused.exit_code == 2 and "unknown kernel path 'sse9'" in refused.output


def test_generate_measures_repeated_requests_with_answer_memory(spec_bundle, tmp_path):
    """--ask-again asks every prompt a second time (kind "again", reported apart), every mode still
    lossless with --answer-memory (the recital itself: test_suffix.py); --repeats above 1 is refused."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "kind": "chat", "prompt": "the quick brown fox"}))
    out = tmp_path / "bench.json"
    args = ["generate", "--bundle", str(spec_bundle()), "--prompts", str(prompts), "--modes", "ar,suffix",
            "--max-new-tokens", "24", "--threads", "1", "--answer-memory", "1024", "--ask-again"]
    result = CliRunner().invoke(main, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert all(report["lossless"].values()) and set(report["speedup_by_kind"]["suffix"]) == {"all", "chat", "again"}
    runs = report["modes"]["suffix"]
    assert report["answer_memory"] == 1024 and "a-again" in runs["outputs"]
    result = CliRunner().invoke(main, [*args, "--repeats", "3"])
    assert result.exit_code != 0 and "use --repeats 1" in result.output
