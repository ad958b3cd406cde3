"""`dflash-bench soak`: every mode, greedy and sampled, memory watched, full capacity lossless."""

import json

from click.testing import CliRunner

from dflash.bench import cli as bench
from dflash.bench.soak import soak

MODES = ["ar", "lookup", "self-int8", "self-int8-tree", "draft-lm", "draft-lm-tree"]


def test_soak_runs_every_mode(spec_bundle, tmp_path):
    out = tmp_path / "soak.json"
    result = CliRunner().invoke(bench.main, ["soak", "--bundle", str(spec_bundle()), "--n", "12",
                                             "--max-new-tokens", "16", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["modes"] == MODES and report["passed"] and not report["greedy_mismatches"]
    assert report["full_capacity"].keys() == set(MODES)
    for mode, run in report["full_capacity"].items():  # up to a full cache, identical to ar
        assert run["finish_reason"] == "length" and run["same_as_ar"] and run["cache_rows"] == 128, mode
    assert sum(report["finish_reasons"].values()) == 12
    assert report["peak_growth_pct"] <= 5 and report["peak_rss_mib"]["end"] > 0
    assert "[  12/12] draft-lm-tree" in result.output and "passed" in result.output


def test_soak_fails_when_memory_grows(spec_bundle):
    readings = iter(range(100, 1000, 10))  # peak RSS 10 MiB higher at every reading (after each generation, and at the end)

    def growing():
        peak = next(readings)
        return peak, peak

    report = soak(spec_bundle(), 3, modes=["ar", "lookup"], max_new_tokens=4, full=False, memory=growing,
                  echo=lambda text: None)
    assert not report["passed"]
    assert report["problems"] == ["peak RSS grew 40.0% after warm-up (100 -> 140 MiB), more than 5.0%"]
