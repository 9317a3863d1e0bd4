"""The reference generated from the schema's field docstrings: `--help-config` and README's table."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import Any

from megazero.config.parse import section_fields, type_name
from megazero.config.schema import SECTIONS


def field_docs(section: str) -> dict[str, str]:
    """Field name -> the docstring written under it in the section's class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(SECTIONS[section])))
    cls = tree.body[0]
    assert isinstance(cls, ast.ClassDef)
    docs = {}
    for node, after in zip(cls.body, cls.body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def show_value(value: Any) -> str:
    """A default as it is written in YAML or on the command line."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return f"{value:g}" if isinstance(value, float) else str(value)


def config_keys() -> list[tuple[str, str, str, str]]:
    """(section.key, type, default, doc) for every config key, in declaration order."""
    rows = []
    for section, cls in SECTIONS.items():
        docs, types, defaults = field_docs(section), section_fields(section), cls()
        for f in dataclasses.fields(cls):
            rows.append((f"{section}.{f.name}", type_name(types[f.name]), show_value(getattr(defaults, f.name)),
                         docs.get(f.name, "")))
    return rows


def reference() -> str:
    """Every key with its type, default and docstring (`megazero-train --help-config`)."""
    lines = []
    for key, kind, default, doc in config_keys():
        lines.append(f"  --{key} {default}  ({kind})")
        lines.extend(textwrap.wrap(doc, 96, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


def markdown_table() -> str:
    """README's config-key table (tests/unit/test_config.py checks README against it)."""
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for row in config_keys():
        key, kind, default, doc = (cell.replace("|", "\\|") for cell in row)
        lines.append(f"| `{key}` | {kind} | `{default}` | {doc} |")
    return "\n".join(lines)
