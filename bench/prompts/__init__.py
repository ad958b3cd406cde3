"""The project's benchmark prompts (see README.md here) and the prompt-file reader."""

from __future__ import annotations

import json
from pathlib import Path

import click

BENCHMARK = Path(__file__).parent / "benchmark.jsonl"
QUALITY_TEXT = Path(__file__).parent / "quality.txt"


def load_prompts(path) -> list[dict]:
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "id" not in row or ("messages" in row) == ("prompt" in row):
            raise click.ClickException(f"{path}:{n}: a row needs an id and either messages or prompt")
        rows.append(row)
    return rows
