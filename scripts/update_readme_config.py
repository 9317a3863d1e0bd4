"""Regenerate the generated blocks of the docs: the config-key table in docs/configuration.md (from the
config dataclasses' field docstrings), and in docs/migration.md the Megatron-LM migration table and
defaults (megazero/config/megatron.py) and the DeepSpeed migration table (megazero/config/deepspeed.py).

    python scripts/update_readme_config.py

Run it after adding or changing a config key, a Megatron flag or a DeepSpeed key; tests/unit/test_config.py,
tests/e2e/test_megatron_flags.py and tests/e2e/test_deepspeed_config.py fail while the docs and the code disagree.
(The name is from when these tables were in README.md.)
"""

from __future__ import annotations

import argparse
import os
import sys

from megazero.atomic import atomic_write
from megazero.config import deepspeed, megatron
from megazero.config.help import markdown_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIG_DOC = "docs/configuration.md"  # the config-key table
MIGRATION_DOC = "docs/migration.md"  # the Megatron-LM and DeepSpeed tables

BLOCKS = (  # (file, start marker, end marker, text between them, whether it stands on lines of its own)
    (CONFIG_DOC, "<!-- config-keys:start (scripts/update_readme_config.py) -->", "<!-- config-keys:end -->",
     markdown_table, True),
    (MIGRATION_DOC, "<!-- megatron-flags:start (scripts/update_readme_config.py) -->", "<!-- megatron-flags:end -->",
     megatron.markdown_table, True),
    (MIGRATION_DOC, "<!-- megatron-defaults:start -->", "<!-- megatron-defaults:end -->",
     megatron.defaults_table, False),
    (MIGRATION_DOC, "<!-- deepspeed-keys:start (scripts/update_readme_config.py) -->", "<!-- deepspeed-keys:end -->",
     deepspeed.markdown_table, True),
)


def fill(name: str, text: str) -> str:
    """The text of docs file `name` with each of its generated blocks replaced by its current content."""
    for doc, start, end, content, own_lines in BLOCKS:
        if doc != name:
            continue
        if start not in text or end not in text:
            sys.exit(f"error: {name} has no {start} ... {end} block to fill; add the two markers where it goes")
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        sep = "\n" if own_lines else ""
        text = f"{head}{start}{sep}{content()}{sep}{end}{tail}"
    return text


def main() -> None:
    # No options: a parser so that --help shows this docstring instead of rewriting the docs.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    for name in dict.fromkeys(doc for doc, *_ in BLOCKS):
        path = os.path.join(ROOT, name)
        with open(path) as f:
            text = f.read()
        with atomic_write(path, "w") as f:
            f.write(fill(name, text))
        print(f"updated the generated tables in {path}")


if __name__ == "__main__":
    main()
