"""Writing a bundle: a folder a user copies to a device.

Everything is written into a temporary sibling folder and renamed into place at the
end, so an interrupted export never leaves a folder that looks like a valid bundle.
"""

from __future__ import annotations

import contextlib
import errno
import json
import shutil
from pathlib import Path

FORMAT_VERSION = 1
MANIFEST = "dflash.json"


class DiskFullError(OSError):
    """The disk filled up during an export (the partial files are removed)."""


def disk_full(error: BaseException, out: Path) -> DiskFullError | None:
    """A clear DiskFullError for a write that failed with ENOSPC/EDQUOT, else None. (numpy's
    `tofile`, which the ONNX exporter saves weights with, raises a bare OSError without errno.)"""
    if not isinstance(error, OSError):
        return None
    if error.errno not in (errno.ENOSPC, errno.EDQUOT) and "Not enough free space" not in str(error):
        return None
    where = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(where).free / 2**20
    return DiskFullError(f"the disk is full: no space left on the device while writing {out} "
                         f"({free:.0f} MiB free now). The partial export was removed and {out} is unchanged; "
                         "free up disk space or write the bundle to another disk, then export again.")


@contextlib.contextmanager
def staging(out: Path, overwrite: bool):
    """Yield a temporary folder; on success it replaces `out`, on failure it is removed."""
    out = out.resolve()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        clear = disk_full(e, out)
        if clear:
            raise clear from e
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def write_tokenizer(tokenizer, folder: Path) -> dict:
    """tokenizer.json and the chat template, and the manifest fields that describe them."""
    tokenizer.backend_tokenizer.save(str(folder / "tokenizer.json"))
    fields = {"tokenizer": "tokenizer.json", "chat_template": None,
              "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        (folder / "chat_template.jinja").write_text(template)
        fields["chat_template"] = "chat_template.jinja"
    return fields


def eos_token_ids(generation_config, tokenizer) -> list[int]:
    ids = generation_config.eos_token_id if generation_config else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def write_manifest(folder: Path, manifest: dict) -> None:
    manifest = {"format_version": FORMAT_VERSION, **manifest}
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(folder / MANIFEST)  # atomic: a crash never leaves half a manifest
