"""Reading and checking a bundle's manifest (dflash.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

FORMAT_VERSION = 1
MANIFEST = "dflash.json"
REQUIRED = ("graphs", "vocab_size", "max_len", "kv", "taps", "attention", "eos_token_ids", "tokenizer")


class BundleError(ValueError):
    """A bundle the runtime cannot run; the message names the file and the fix."""


@dataclass
class Bundle:
    folder: Path
    manifest: dict = field(repr=False)

    def __getattr__(self, name):
        try:
            return self.manifest[name]
        except KeyError:
            raise AttributeError(name) from None

    def graph_path(self, name: str) -> Path:
        return self.folder / self.manifest["graphs"][name]["file"]

    def file(self, name: str | None) -> Path | None:
        return self.folder / name if name else None

    def tap_columns(self, layers: list[int]):
        """Where the states of `layers` sit in the target's taps output (which concatenates the
        bundle's tap layers), in the order given: a drafter may read a subset of them."""
        missing = [t for t in layers if t not in self.manifest["taps"]]
        if missing:
            raise BundleError(f"a drafter reads target layers {layers} but {self.folder}'s taps are "
                              f"{self.manifest['taps']}: re-export the target with those taps")
        return tap_columns(self.manifest["taps"], self.manifest["hidden_size"], layers)


def new_cache(kv: dict, capacity: int):
    """A zeroed KV cache buffer [1, kv_heads, capacity, row] for the layout `kv` of a manifest,
    whose rows are stored in kv["dtype"] (fp32 by default; fp16, int8: see dflash.ops)."""
    import numpy as np

    from dflash.ops import KV_DTYPES, kv_row_width

    kv_dtype = kv.get("dtype", "fp32")
    if kv_dtype not in KV_DTYPES:
        raise BundleError(f"the manifest's KV cache dtype {kv_dtype!r} is none of {', '.join(KV_DTYPES)}: "
                          "export the bundle again with this dflash-ort")
    width = kv_row_width(kv_dtype, kv["head_dim"])
    return np.zeros((1, kv["kv_heads"], capacity, width), KV_DTYPES[kv_dtype][0])


def tap_columns(taps: list[int], hidden: int, layers: list[int]):
    """The columns of `layers` (each among `taps`) in a row of concatenated tap states."""
    import numpy as np

    return np.concatenate([np.arange(taps.index(t) * hidden, (taps.index(t) + 1) * hidden) for t in layers])


def load_bundle(folder) -> Bundle:
    folder = Path(folder).expanduser()
    path = folder / MANIFEST
    if not folder.is_dir():
        raise BundleError(f"bundle folder {folder} does not exist; export one with "
                          f"`dflash-export target default --out {folder}`")
    if not path.is_file():
        raise BundleError(f"{path} is missing: {folder} is not a dflash bundle "
                          "(or its export did not finish); export it again with dflash-export")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BundleError(f"{path} is not valid JSON ({e}); export the bundle again") from e
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        fix = "upgrade dflash-ort" if newer else "export the bundle again with this dflash-ort"
        raise BundleError(f"{path} has format version {version}; this runtime reads version "
                          f"{FORMAT_VERSION}: {fix}")
    missing = [k for k in REQUIRED if k not in manifest]
    if missing:
        raise BundleError(f"{path} lacks {', '.join(missing)}; export the bundle again")
    bundle = Bundle(folder, manifest)
    for name in manifest["graphs"]:
        _check_graph_files(bundle.graph_path(name))
    for name in (manifest["tokenizer"], manifest.get("chat_template")):
        if name and not (folder / name).is_file():
            raise BundleError(f"{folder / name} is missing from the bundle; export it again")
    return bundle


def _check_graph_files(graph: Path) -> None:
    """The graph and its weights, which exports always keep in `<graph>.data` beside it."""
    if not graph.is_file():
        raise BundleError(f"{graph} is missing from the bundle; export it again")
    data = graph.with_name(graph.name + ".data")
    if not data.is_file():
        raise BundleError(f"{data} is missing: the graph's weights live there; copy the whole bundle")
