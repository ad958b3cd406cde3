"""Compact data shards: what the campaign commits so a later session can continue.

A shard holds the target's answers as uint16 token ids with the target's argmax at every
answer position, and for each row where its prompt came from: the messages themselves
(text the project or the target wrote), a reference into an offline text source, or the
row it follows up.  Prompts are rebuilt from these with the bundle's chat template; tap
features and soft labels are recomputed by the fit, never stored.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from . import prompts


def write(path: Path, rows: list[dict]) -> None:
    """rows: {id, kind, source, messages | ref | parent+followup, answer, greedy, ended, temperature}."""
    answers = [np.asarray(r["answer"], np.uint16) for r in rows]
    meta = [{k: v for k, v in r.items() if k not in ("answer", "greedy")} for r in rows]
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, answers=np.concatenate(answers), greedy=np.concatenate(
        [np.asarray(r["greedy"], np.uint16) for r in rows]), offsets=np.cumsum([0] + [len(a) for a in answers]),
        meta=np.array(json.dumps(meta)))
    tmp.rename(path)  # a shard exists whole or not at all


def read(path: Path) -> list[dict]:
    with np.load(path) as z:
        answers, greedy, offsets = z["answers"], z["greedy"], z["offsets"]
        meta = json.loads(str(z["meta"]))
    for i, row in enumerate(meta):
        row["answer"] = answers[offsets[i]:offsets[i + 1]].tolist()
        row["greedy"] = greedy[offsets[i]:offsets[i + 1]].tolist()
    return meta


def round_of(row_id: str) -> int:
    """The round a row was written in: ids end in ROUND-INDEX (data.round_id)."""
    return int(row_id.rsplit("-", 1)[0][-5:])


def read_all(folder: Path) -> list[dict]:
    return [row for path in sorted(Path(folder).glob("shard-*.npz")) for row in read(path)]


def messages(row: dict, by_id: dict, decode) -> list[dict]:
    """The conversation a row's answer replies to, rebuilt from the row's provenance."""
    if "messages" in row:
        return row["messages"]
    if "ref" in row:
        return [{"role": "user", "content": prompts.grounded_text(row["ref"])}]
    parent = by_id[row["parent"]]
    return messages(parent, by_id, decode) + [{"role": "assistant", "content": decode(parent["answer"])},
                                              {"role": "user", "content": row["followup"]}]
