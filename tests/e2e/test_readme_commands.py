"""The commands the README and docs/ show work on a fresh clone, with a directory of one's own
for their outputs.

A shell block is runnable when the line before its ```bash fence is `<!-- runnable -->` (cheap:
run by the default suite) or `<!-- runnable slow -->` (trains: run by the slow walk). Blocks run
in a copy of the tracked files (nothing built yet: no data/, no runs/), README.md first and then
docs/*.md by name, so a later block may use what an earlier one made (the main job's checkpoint).
What is not the user's command is changed, and only this: `pip install ... &&` is dropped (the
environment is set up already, and tests have no network); training commands that do not set
their own iteration count get SHRINK (the slow walk); the default suite checks each slow block's
`megazero.train` commands with --validate-only --config-only instead of training.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import REPO
from megazero.harness.spawn import free_port

MARK = re.compile(r"^<!--\s*runnable(?P<slow>\s+slow)?\s*-->\n```bash\n(?P<body>.*?)^```", re.M | re.S)
SHRINK = "--train.iters {iters} --train.log_interval 2 --train.eval_interval 4 --train.eval_iters 1 --checkpoint.interval 4"
"""Appended to a training command whose own arguments set no iteration count (ITERS=500 in the
environment is outvoted): {iters} grows by 4 per such command, so a run that resumes goes on."""
TRAINS = re.compile(r"scripts/pretrain_gpt\.sh|-m megazero\.train")
SETS_ITERS = re.compile(r"--train[.-]iters")


@dataclass
class Block:
    where: str  # file:line, for messages
    slow: bool
    commands: list[str]  # logical lines: backslash continuations joined, comments kept


def marked_blocks() -> list[Block]:
    """Every marked block of README.md, then docs/*.md by name."""
    blocks = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = path.read_text()
        for m in MARK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            commands = [c.strip() for c in m.group("body").replace("\\\n", " ").splitlines() if c.strip()]
            blocks.append(Block(f"{path.relative_to(REPO)}:{line}", bool(m.group("slow")), commands))
    return blocks


def _without_comment(command: str) -> tuple[str, str]:
    """(the command, its trailing `# comment` or '') so that arguments go before the comment."""
    code, sep, comment = command.partition(" #")
    return code.rstrip(), sep + comment


def for_test(command: str, iters: int = 0) -> str:
    """The command as the test runs it (the module docstring says what changes); `iters` > 0
    shrinks training to that many iterations."""
    command = re.sub(r"pip install [^&]*&&\s*", "", command)
    code, comment = _without_comment(command)
    if iters and TRAINS.search(code) and not SETS_ITERS.search(code):
        code += " " + SHRINK.format(iters=iters)
    return code + comment


def validate_only(command: str) -> str | None:
    """A `megazero.train` command (under torchrun, megazero.launch or neither) as a config check for its world size;
    None for any other command, and for one that reads the main job's data/ (not made yet)."""
    code, _ = _without_comment(command)
    m = re.match(r"(?:(?:torchrun|python -m megazero\.launch) --nproc_per_node (\d+) )?(?:python )?-m megazero\.train\b(.*)", code)
    if not m or re.search(r"\bdata/", code):
        return None
    return f"python -m megazero.train --validate-only --config-only --world-size {m.group(1) or 1}{m.group(2)}"


def fresh_clone(tmp_path: Path) -> Path:
    """The tracked files as they are in this checkout (edits included), nothing built."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    clone = tmp_path / "clone"
    for name in filter(None, files.stdout.split("\0")):
        if (REPO / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, clone / name)
    return clone


def run_in(clone: Path, script: str, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(clone), "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    for key in ("RUN_DIR", "DATA_DIR", "CONFIG", "ITERS", "NPROC", "TP", "PP", "ZERO_STAGE", "TOKENIZER", "INPUT"):
        env.pop(key, None)  # the script's own defaults, as on a fresh machine
    return subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], cwd=clone, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_marked_blocks_name_files_the_clone_has():
    """The marks are found, and every script and config a marked command names is tracked."""
    blocks = marked_blocks()
    assert sum(b.where.startswith("README.md") for b in blocks) >= 3
    assert any(not b.slow for b in blocks) and any(b.slow for b in blocks)
    tracked = set(subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                                 check=True).stdout.split())
    for block in blocks:
        for command in block.commands:
            for name in re.findall(r"\b(?:scripts|configs|data_tools)/[\w./-]+", command):
                assert name in tracked, f"{block.where}: {name} is not in the repository"


def test_cheap_commands_and_training_configs_work_on_a_fresh_clone(tmp_path):
    """Short form: the cheap blocks (the planner) as they are, and each training command of the
    slow blocks as a config check for its world size."""
    clone = fresh_clone(tmp_path)
    checks = [(b.where, "\n".join(map(for_test, b.commands))) for b in marked_blocks() if not b.slow]
    checks += [(b.where, cmd) for b in marked_blocks() if b.slow for c in b.commands if (cmd := validate_only(c))]
    assert len(checks) >= 4  # the planner's two, README's training line, the Llama family's
    for where, script in checks:
        proc = run_in(clone, script, timeout=300)
        assert proc.returncode == 0, f"{where}: {script}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"


@pytest.mark.slow
def test_every_marked_command_works_on_a_fresh_clone(tmp_path):
    """The whole walk: every marked block in order, training shrunk to a few iterations."""
    clone, trained = fresh_clone(tmp_path), 0
    for block in marked_blocks():
        commands = []
        for command in block.commands:
            trained += bool(TRAINS.search(command))
            commands.append(for_test(command, iters=4 * trained))
        script = "\n".join(commands)
        proc = run_in(clone, script, timeout=1800)
        assert proc.returncode == 0, f"{block.where}: {script}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    assert (clone / "runs" / "gpt2-cpu-demo" / "checkpoints" / "latest").is_file()
