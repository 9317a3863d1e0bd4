"""Every entry point's --help is complete in itself (issue 39, 7 and 8): no option without a help
text or its default, no description cut to its first line, no "(see above)" of text not shown."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO


@pytest.mark.parametrize("command", [["-m", "megazero.generate"], ["scripts/bench_activation.py"]])
def test_help_names_every_option_with_its_meaning_and_default(command):
    out = subprocess.run([sys.executable, *command, "--help"], cwd=REPO, capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}).stdout
    assert "see above" not in out
    options = out[out.index("options:"):]
    for flag in ("--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--batch-size") \
            if "generate" in command[-1] else ("--long", "--long-seq", "--long-recompute", "--long-zero", "--cp"):
        # The flag's help starts on its own line or after it: the text up to the next option is more than the flag.
        after = options[options.index(f"  {flag} ") + len(flag) + 2:].split("\n  --")[0]
        assert len(after.split()) > 3, f"{flag} has no help: {after!r}"
    assert options.count("(default: ") >= 5


def test_bench_scripts_show_their_whole_docstring():
    for path in sorted((REPO / "scripts").glob("bench_*.py")):
        assert "description=__doc__.splitlines()[0]" not in path.read_text(), f"{path.name}: --help cuts its docstring"
