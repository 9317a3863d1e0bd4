"""Regenerate README.md's config-key table from the config dataclasses' field docstrings.

    python scripts/update_readme_config.py

Run it after adding or changing a config key; tests/test_config.py fails while the table
and the dataclasses disagree.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megazero.atomic import atomic_write  # noqa: E402
from megazero.config import markdown_table  # noqa: E402

START, END = "<!-- config-keys:start (scripts/update_readme_config.py) -->", "<!-- config-keys:end -->"


def main() -> None:
    path = os.path.join(ROOT, "README.md")
    with open(path) as f:
        text = f.read()
    if START not in text or END not in text:
        sys.exit(f"error: README.md has no {START} ... {END} block to fill; add the two markers where the table goes")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    with atomic_write(path, "w") as f:
        f.write(f"{head}{START}\n{markdown_table()}\n{END}{tail}")
    print(f"updated the config-key table in {path}")


if __name__ == "__main__":
    main()
