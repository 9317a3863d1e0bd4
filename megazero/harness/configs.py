"""The one config builder of benchmarks and tests: a config file of this checkout or a dict of
sections, command-line style overrides on top, resolved and checked for a world as a run is;
and the model-shape flags the benchmarks that build a GPT-2 of their own share."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Mapping, Sequence, Union

from megazero.config import Config, build_config, load_yaml
from megazero.train.preflight import resolve_and_validate

CHECKOUT = Path(__file__).resolve().parents[2]  # the repository megazero is used from (configs/, scripts/)
TINY_CONFIG = "configs/gpt2-tiny.yaml"


def make_config(args: Sequence[str] = (), base: Union[str, Path, Mapping] = TINY_CONFIG,
                world: int | None = None) -> Config:
    """`base` (a config file, relative to the checkout or absolute, or a dict of sections) with
    the command-line style `args` on top; resolved and checked for a world of `world` ranks as a
    run is, when `world` is given (unchecked: for callers that look at the raw config)."""
    raw = dict(base) if isinstance(base, Mapping) else load_yaml(str(CHECKOUT / base))
    cfg = build_config(raw, list(args))
    if world is not None:
        resolve_and_validate(cfg, world)
    return cfg


def add_shape_flags(parser: argparse.ArgumentParser, layers: int, hidden: int, heads: int, seq: int, vocab: int,
                    micro: int) -> None:
    """A benchmark's --layers --hidden --heads --seq --vocab --micro: the GPT-2 shape it builds
    (model_section) and its micro-batch size, with this benchmark's defaults."""
    for flag, default, key in (("layers", layers, "model.num_layers"), ("hidden", hidden, "model.hidden_size"),
                               ("heads", heads, "model.num_heads"), ("seq", seq, "model.seq_length"),
                               ("vocab", vocab, "model.vocab_size"), ("micro", micro, "train.micro_batch_size")):
        parser.add_argument(f"--{flag}", type=int, default=default, help=f"{key} (default: %(default)s)")


def model_section(args: argparse.Namespace) -> dict:
    """The config's model section for add_shape_flags' values."""
    return {"num_layers": args.layers, "hidden_size": args.hidden, "num_heads": args.heads,
            "seq_length": args.seq, "vocab_size": args.vocab}
