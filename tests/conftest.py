import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUNDLE = ROOT / "bundles" / "smollm2"
BENCHMARK_PROMPTS = ROOT / "bench" / "prompts" / "benchmark.jsonl"  # the project's own prompt set


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(arch) -> (bundle folder, HF model folder), exported once per session."""
    from dflash.export.cli import export_target
    from tiny_models import save_model_folder

    made = {}

    def get(arch: str, **export_options):
        key = (arch, tuple(sorted(export_options.items())))
        if key not in made:
            base = tmp_path_factory.mktemp(f"tiny_{arch}")
            hf = save_model_folder(arch, base / "hf")
            options = {"max_len": 128, **export_options}
            export_target(str(hf), base / "bundle", **options)
            made[key] = (base / "bundle", hf)
        return made[key]

    return get


@pytest.fixture(scope="session")
def default_bundle():
    """The real default model's bundle (exported by `make demo`, or here if missing)."""
    from dflash.export.cli import export_target

    if not (DEFAULT_BUNDLE / "dflash.json").is_file():
        export_target("default", DEFAULT_BUNDLE, overwrite=True)
    return DEFAULT_BUNDLE


@pytest.fixture(scope="session")
def spec_bundle(tiny, tmp_path_factory):
    """spec_bundle(arch, dtype, kv_dtype) -> a tiny target with drafters self-int8 and draft-lm (another
    random model with the same tokenizer), exported once per session."""
    import shutil

    from dflash.export.cli import export_draft_lm
    from tiny_models import save_model_folder

    made = {}

    def get(arch="llama", dtype="fp32", kv_dtype="fp32"):
        if (arch, dtype, kv_dtype) not in made:
            folder = tmp_path_factory.mktemp(f"spec_{arch}_{dtype}_{kv_dtype}") / "bundle"
            shutil.copytree(tiny(arch, dtype=dtype, kv_dtype=kv_dtype)[0], folder)
            other = save_model_folder("qwen2", folder.parent / "other_hf", layers=2, seed=1)
            export_draft_lm(None, folder, "int8")
            export_draft_lm(str(other), folder)
            made[arch, dtype, kv_dtype] = folder
        return made[arch, dtype, kv_dtype]

    return get
