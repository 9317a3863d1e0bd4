"""Data a script derives by itself (scripts/finetune_gpt.sh's question/answer set), rebuilt when
the tokenizer it is to be made with changes, and the tokenizer a Hugging Face directory brings.

After a successful build the script records a manifest beside the set, PREFIX.derived.json:
which tokenizer made it (the spec as given, and its identity: kind, size, sha256 of the files).
The next run compares that identity with the tokenizer it would use now, so the same files
under another path are the same tokenizer, and another tokenizer means one line and a rebuild.

A set without a manifest is the user's own and is never rebuilt (training's own check refuses
one made with another tokenizer, naming both), except at the script's own default place
(--own), which versions of the script before the manifest filled without one: that set is
judged by the tokenizer its .meta.json sidecar (written by preprocess_data.py) names.

    python -m megazero.harness.derived_data check PREFIX SPEC [--own]
        prints why PREFIX must be built or rebuilt with tokenizer SPEC; nothing when it is current
    python -m megazero.harness.derived_data record PREFIX SPEC
        writes PREFIX's manifest (after a successful build)
    python -m megazero.harness.derived_data tokenizer DIR
        prints the spec of a Hugging Face directory's tokenizer files; status 1 when it has none
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

from megazero.atomic import write_text
from megazero.data import read_json
from megazero.data.gpt_dataset import same_tokenizer
from megazero.data.indexed import index_path, read_metadata
from megazero.data.tokenizer import build_tokenizer, spec_of_directory
from megazero.errors import report_errors

MADE_BY = "scripts/finetune_gpt.sh"


def manifest_path(prefix: str) -> str:
    return f"{prefix}.derived.json"


def rebuild_reason(prefix: str, spec: str, own_place: bool) -> Optional[str]:
    """Why the set at PREFIX must be (re)built with tokenizer SPEC; None when it is current, or
    when it is the user's own (no manifest, and not at the script's own place)."""
    if not os.path.isfile(index_path(prefix)):
        return f"building {prefix} with tokenizer {spec}"
    made = _made_with(prefix, own_place)
    if made is None:
        return None
    made_spec, identity = made
    if identity and same_tokenizer(identity, build_tokenizer(spec).identity()):
        return None
    return f"rebuilding {prefix}: it was made with tokenizer {made_spec or 'unknown'}, not {spec}"


def _made_with(prefix: str, own_place: bool) -> Optional[tuple[Optional[str], dict[str, Any]]]:
    """(spec, identity) of the tokenizer that made the set, per its manifest, else (at the
    script's own place) per its sidecar; None for a set that is the user's own."""
    manifest = read_json(manifest_path(prefix), "remove it: the set is then rebuilt")
    if isinstance(manifest, dict):
        return manifest.get("tokenizer"), manifest.get("identity") or {}
    if not own_place:
        return None
    meta = read_metadata(prefix) or {}
    return meta.get("tokenizer_spec"), meta.get("tokenizer") or {}


def record(prefix: str, spec: str) -> None:
    """PREFIX's manifest: the set was made by the script, with tokenizer SPEC."""
    manifest = {"made_by": MADE_BY, "tokenizer": spec, "identity": build_tokenizer(spec).identity()}
    write_text(manifest_path(prefix), json.dumps(manifest, indent=1) + "\n")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megazero.harness.derived_data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="why PREFIX must be (re)built; nothing when it is current")
    check.add_argument("prefix")
    check.add_argument("spec")
    check.add_argument("--own", action="store_true", help="PREFIX is the script's own default place")
    made = commands.add_parser("record", help="write PREFIX's manifest after a successful build")
    made.add_argument("prefix")
    made.add_argument("spec")
    commands.add_parser("tokenizer", help="the spec of a Hugging Face directory's tokenizer").add_argument("dir")
    args = parser.parse_args(argv)
    with report_errors(OSError):
        if args.command == "check":
            print(rebuild_reason(args.prefix, args.spec, args.own) or "")
        elif args.command == "record":
            record(args.prefix, args.spec)
        else:
            spec = spec_of_directory(args.dir)
            if spec is None:
                sys.exit(1)
            print(spec)


if __name__ == "__main__":
    main()
