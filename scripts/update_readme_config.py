"""Regenerate README.md's generated blocks: the config-key table (from the config dataclasses'
field docstrings), the Megatron-LM migration table and defaults (megazero/train/megatron_flags.py)
and the DeepSpeed migration table (megazero/deepspeed_config.py).

    python scripts/update_readme_config.py

Run it after adding or changing a config key, a Megatron flag or a DeepSpeed key; tests/test_config.py,
tests/test_megatron_flags.py and tests/test_deepspeed_config.py fail while README and the code disagree.
"""

from __future__ import annotations

import os
import sys

from megazero import deepspeed_config
from megazero.atomic import atomic_write
from megazero.config import markdown_table
from megazero.train import megatron_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BLOCKS = (  # (start marker, end marker, text between them, whether it stands on lines of its own)
    ("<!-- config-keys:start (scripts/update_readme_config.py) -->", "<!-- config-keys:end -->", markdown_table, True),
    ("<!-- megatron-flags:start (scripts/update_readme_config.py) -->", "<!-- megatron-flags:end -->",
     megatron_flags.markdown_table, True),
    ("<!-- megatron-defaults:start -->", "<!-- megatron-defaults:end -->", megatron_flags.defaults_table, False),
    ("<!-- deepspeed-keys:start (scripts/update_readme_config.py) -->", "<!-- deepspeed-keys:end -->",
     deepspeed_config.markdown_table, True),
)


def fill(text: str) -> str:
    """README's text with every generated block replaced by its current content."""
    for start, end, content, own_lines in BLOCKS:
        if start not in text or end not in text:
            sys.exit(f"error: README.md has no {start} ... {end} block to fill; add the two markers where it goes")
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        sep = "\n" if own_lines else ""
        text = f"{head}{start}{sep}{content()}{sep}{end}{tail}"
    return text


def main() -> None:
    path = os.path.join(ROOT, "README.md")
    with open(path) as f:
        text = f.read()
    with atomic_write(path, "w") as f:
        f.write(fill(text))
    print(f"updated the generated tables in {path}")


if __name__ == "__main__":
    main()
