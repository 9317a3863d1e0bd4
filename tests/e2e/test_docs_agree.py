"""The docs' statements that the code decides (issue 39, 8): the planner samples in
docs/planner.md are what `python -m megazero.plan` prints, and every statement of the rank order
(README, docs, parallel/grid.py) is the order ProcessGrid lays ranks out in, the experts' folding
(issue 45, 2) included."""

from __future__ import annotations

import re
import shlex

import pytest

from helpers import REPO
from megazero.parallel.grid import ProcessGrid

SAMPLE = re.compile(r"```bash\npython -m megazero\.plan (?P<args>[^\n]*)\n```\n\n```\n(?P<out>.*?)\n```", re.S)


def _samples() -> list[tuple[str, str]]:
    return [(m["args"], m["out"]) for m in SAMPLE.finditer((REPO / "docs" / "planner.md").read_text())]


def test_docs_hold_planner_samples():
    assert len(_samples()) >= 2


@pytest.mark.parametrize("args, printed", _samples())
def test_planner_sample_is_what_the_planner_prints(args, printed, capsys, monkeypatch):
    from megazero.plan.__main__ import main
    monkeypatch.chdir(REPO)
    main(shlex.split(args))
    assert capsys.readouterr().out.rstrip("\n") == printed, "docs/planner.md is stale: rerun its commands"


# Each statement of the order, innermost first, as the docs word it.
ORDER = re.compile(r"\b(?:TP innermost[^.]*?|tp fastest[^.]*?|tensor parallel innermost[^.]*?)(?:PP outermost|then pp|"
                   r"pipeline outermost)", re.I | re.S)


def test_every_statement_of_the_rank_order_is_the_grids():
    grid = ProcessGrid(tp=2, pp=2, dp=2, rank=0, cp=2)
    # Rank r+1 moves the innermost dimension first: tp, then cp, dp, pp.
    moves = []
    for r in range(1, grid.world_size):
        a, b = grid.coords(r - 1), grid.coords(r)
        moves += [d for d in ("tp", "cp", "dp", "pp") if getattr(a, d) != getattr(b, d) and d not in moves]
    assert moves == ["tp", "cp", "dp", "pp"]
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "megazero" / "parallel" / "grid.py"]
    statements = [(f.name, m[0]) for f in files for m in ORDER.finditer(f.read_text())]
    assert len(statements) >= 3, statements
    for name, text in statements:
        words = re.findall(r"\b(tp|cp|dp|pp|tensor|context|data|pipeline)\b", " ".join(text.split()).lower())
        named = [{"tensor": "tp", "context": "cp", "data": "dp", "pipeline": "pp"}.get(w, w) for w in words]
        assert list(dict.fromkeys(named)) == moves, f"{name}: {text!r}"


EXPERT_ORDER = re.compile(r"\betp fastest[^.]*?pp outermost", re.I | re.S)
EXPERT_TABLE = re.compile(r"^\| rank \| tp \| cp \| dp \| pp \| etp \| ep \| edp \|\n\|[-|]+\|\n((?:\|[ 0-9|]+\|\n)+)", re.M)


def test_every_statement_of_the_expert_order_is_the_grids():
    grid = ProcessGrid(tp=2, pp=2, dp=2, rank=0, cp=2, ep=2, etp=2)  # etp 2 x ep 2 x edp 2 per stage
    moves = []
    for r in range(1, grid.world_size):
        a, b = grid.expert_coords(r - 1), grid.expert_coords(r)
        moves += [d for d in ("etp", "ep", "edp", "pp") if getattr(a, d) != getattr(b, d) and d not in moves]
    assert moves == ["etp", "ep", "edp", "pp"]
    files = [*sorted((REPO / "docs").glob("*.md")), REPO / "megazero" / "parallel" / "grid.py"]
    statements = [(f.name, m[0]) for f in files for m in EXPERT_ORDER.finditer(f.read_text())]
    assert len(statements) >= 2, statements
    for name, text in statements:
        assert list(dict.fromkeys(re.findall(r"\b(etp|ep|edp|pp)\b", text.lower()))) == moves, f"{name}: {text!r}"


def test_the_rank_order_table_is_the_grids():
    """docs/parallelism.md's table: tp 2 x cp 2 x dp 2 x pp 1 with ep 4 and etp 1, as its text says."""
    text = (REPO / "docs" / "parallelism.md").read_text()
    assert "tp 2 × cp 2 × dp 2 × pp 1 with ep 4 and etp 1" in text
    table = EXPERT_TABLE.search(text)
    assert table, "docs/parallelism.md lost its rank-order table"
    grid = ProcessGrid(tp=2, pp=1, dp=2, rank=0, cp=2, ep=4, etp=1)
    rows = [[int(v) for v in line.strip("|").split("|")] for line in table[1].splitlines()]
    assert rows == [[r, *(getattr(grid.coords(r), d) for d in ("tp", "cp", "dp", "pp")), *grid.expert_coords(r)[:3]]
                    for r in range(grid.world_size)]
