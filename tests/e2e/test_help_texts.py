"""Every entry point's --help is complete in itself (issue 39, 7 and 8): no option without a help
text or its default, no description cut to its first line, no "(see above)" of text not shown."""

from __future__ import annotations

import json
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


# Runs each script as __main__ up to its parse_args, which hands the parser back instead of parsing;
# prints the options whose help is missing, or lacks the default of an option that takes a value.
_OPTIONS_WITHOUT_HELP = r"""
import argparse, json, runpy, sys

class Parsed(Exception):
    pass

def hand_back(self, args=None, namespace=None):
    raise Parsed(self)

argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = hand_back
missing = {}
for path in sys.argv[1:]:
    sys.argv = [path]
    try:
        runpy.run_path(path, run_name="__main__")
        missing[path] = ["no argparse parser: --help would run the script"]
        continue
    except Parsed as parsed:
        parser = parsed.args[0]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        text = parser._get_formatter()._expand_help(action) if action.help else ""
        needs_default = action.option_strings and action.nargs != 0 and action.default is not None
        if not text.strip() or (needs_default and "default" not in text):
            missing.setdefault(path, []).append("/".join(action.option_strings) or action.dest)
print(json.dumps(missing))
"""


def test_every_option_of_every_script_has_help_with_its_default():
    """Each scripts/*.py option has a help text, and one that takes a value names its default
    (an option without a default says what it does when given)."""
    scripts = sorted(str(p.relative_to(REPO)) for p in (REPO / "scripts").glob("*.py"))
    proc = subprocess.run([sys.executable, "-c", _OPTIONS_WITHOUT_HELP, *scripts], cwd=REPO, capture_output=True,
                          text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {}
