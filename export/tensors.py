"""A model folder's weights, one tensor at a time, in the dtype they are stored in.

The streaming exporter (export/stream.py) reads each weight when it writes it and drops it
after: safetensors files are opened lazily (`safe_open` reads a header, then only the bytes of
the tensor asked for), so the model is never in memory, whatever its size.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .sources import SourceError


class FolderTensors:
    """The tensors of a Hugging Face folder's safetensors files (one file, or shards listed by
    model.safetensors.index.json), by their checkpoint names."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.folder / file for name, file in weight_map.items()}
        else:
            from safetensors import safe_open

            self.files = {}
            for file in sorted(self.folder.glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as f:
                    self.files.update((name, file) for name in f.keys())
        missing = sorted({str(f.name) for f in self.files.values() if not f.is_file()})
        if missing:
            raise SourceError(f"{self.folder}: the weight files {', '.join(missing[:3])} listed in the index are "
                              "missing; copy or download the complete weight files")

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, rows: slice | None = None) -> np.ndarray:
        """The tensor (or the rows `rows` of it) as float32, whatever dtype it is stored in."""
        return self.stored(name, rows).float().numpy()

    def stored(self, name: str, rows: slice | None = None):
        """The tensor (or its rows `rows`) as a torch tensor in the dtype it is stored in."""
        from safetensors import safe_open

        if name not in self.files:
            raise SourceError(f"{self.folder} lacks the weight {name!r}: the weight files are incomplete or belong "
                              "to another model; copy or download the complete weight files")
        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_tensor(name) if rows is None else f.get_slice(name)[rows]

    def shape(self, name: str) -> list[int]:
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as f:
            return list(f.get_slice(name).get_shape())
