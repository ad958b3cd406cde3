import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUNDLE = ROOT / "bundles" / "smollm2"
SHARED_PROMPTS = ROOT.parent / "shared" / "eval" / "prompts.jsonl"


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
