"""Regenerate README.md's generated blocks: the config-key table (from the config dataclasses'
field docstrings), the Megatron-LM migration table and defaults (megazero/config/megatron.py)
and the DeepSpeed migration table (megazero/config/deepspeed.py).

    python scripts/update_readme_config.py

Run it after adding or changing a config key, a Megatron flag or a DeepSpeed key; tests/test_config.py,
tests/test_megatron_flags.py and tests/test_deepspeed_config.py fail while README and the code disagree.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megazero.atomic import atomic_write  # noqa: E402
from megazero.config import deepspeed, megatron  # noqa: E402
from megazero.config.help import markdown_table  # noqa: E402

BLOCKS = (  # (start marker, end marker, text between them, whether it stands on lines of its own)
    ("<!-- config-keys:start (scripts/update_readme_config.py) -->", "<!-- config-keys:end -->", markdown_table, True),
    ("<!-- megatron-flags:start (scripts/update_readme_config.py) -->", "<!-- megatron-flags:end -->",
     megatron.markdown_table, True),
    ("<!-- megatron-defaults:start -->", "<!-- megatron-defaults:end -->", megatron.defaults_table, False),
    ("<!-- deepspeed-keys:start (scripts/update_readme_config.py) -->", "<!-- deepspeed-keys:end -->",
     deepspeed.markdown_table, True),
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
