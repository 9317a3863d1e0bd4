"""Prompts in, completions out, as JSON Lines (`generate --prompts-file F [--output OUT]`).

Each input line is a JSON object with a "prompt" string; its other fields are carried to
the output unchanged. Each output line is that object plus "completion": the generated
continuation (without the prompt). Blank lines are skipped.
"""

from __future__ import annotations

import json
import sys
from typing import Optional

from megazero.atomic import atomic_write
from megazero.errors import UserError


def read_prompts(path: str) -> list[dict]:
    """The records of a prompts file, each with a string "prompt"; one clear line otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise UserError(f"--prompts-file {path} cannot be read ({e.strerror}); pass a JSONL file") from None
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise UserError(f"--prompts-file {path} line {n} is not JSON ({e}); write one JSON object per "
                            f'line, e.g. {{"prompt": "Once upon a time"}}') from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise UserError(f'--prompts-file {path} line {n} has no "prompt" string; write one JSON object per '
                            f'line, e.g. {{"prompt": "Once upon a time"}}')
        records.append(record)
    if not records:
        raise UserError(f"--prompts-file {path} holds no prompts; write one JSON object per line")
    return records


def write_completions(records: list[dict], completions: list[str], output: Optional[str]) -> None:
    """One JSON line per record, with its completion; to `output` (atomically) or stdout."""
    text = "".join(json.dumps({**r, "completion": c}, ensure_ascii=False) + "\n"
                   for r, c in zip(records, completions))
    if output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    with atomic_write(output, "w", encoding="utf-8") as f:
        f.write(text)
