"""Resolution: what the config leaves to megazero, filled in before it is checked."""

from __future__ import annotations

from megazero.config.schema import Config, ConfigError
from megazero.data import DataError
from megazero.data.tokenizer import build_tokenizer


def resolve(cfg: Config) -> None:
    """Fill in what the config leaves to megazero, in place: model.vocab_size auto from data.tokenizer
    (refusing an explicit size the tokenizer does not fit) and the interleaved schedule that 1f1b over
    vpp > 1 chunks per rank is. Without data the vocabulary stays auto: validate says data is missing."""
    choose_data_source(cfg)
    if cfg.data.mock or cfg.data.prefix or cfg.data.stream:
        cfg.model.vocab_size = resolve_vocab_size(cfg)
    if cfg.parallel.vpp > 1 and cfg.parallel.schedule == "1f1b":
        cfg.parallel.schedule = "interleaved"


DATA_SOURCES = ("data.prefix", "data.stream", "data.mock")
"""The keys that name the training data; one run reads one of them."""


def choose_data_source(cfg: Config) -> None:
    """One data source: one given on the command line replaces a config file's (the documented
    precedence: the file's is reset); two given at the same level are refused, naming where."""
    d = cfg.data
    given = [key for key, value in zip(DATA_SOURCES, (d.prefix, d.stream, d.mock)) if value]
    if len(given) < 2:
        return
    on_cli = [key for key in given if key in cfg.cli_keys]
    if len(on_cli) == 1:
        for key in given:
            if key != on_cli[0]:
                setattr(d, key.split(".")[1], False if key == "data.mock" else None)
        return
    where = "on the command line" if on_cli else "in the config file"
    both = on_cli or given
    raise ConfigError(f"{' and '.join(both)} are both given {where}, but a run reads one data source; drop "
                      f"all but one (one given on the command line replaces the config file's)")


MOCK_VOCAB_SIZE = 512
"""model.vocab_size auto for mock data without a tokenizer."""


def resolve_vocab_size(cfg: Config) -> int:
    """model.vocab_size as a number: auto becomes the tokenizer's size; an explicit size must
    hold every token of the tokenizer. (Padding to 128 x tp happens in the model.)"""
    m, d = cfg.model, cfg.data
    tokens = tokenizer_size(d.tokenizer) if d.tokenizer else None
    if m.vocab_size == "auto":
        if tokens is not None:
            return tokens
        if d.mock:
            return MOCK_VOCAB_SIZE
        raise ConfigError("model.vocab_size auto needs data.tokenizer to read the size from; set data.tokenizer "
                          "(e.g. gpt2bpe:DIR) or a number, e.g. --model.vocab_size 50257")
    if tokens is not None and m.vocab_size < tokens:
        raise ConfigError(f"model.vocab_size ({m.vocab_size}) is smaller than data.tokenizer {d.tokenizer!r} "
                          f"({tokens} tokens); set --model.vocab_size auto (or at least {tokens})")
    return m.vocab_size


def tokenizer_size(spec: str) -> int:
    """data.tokenizer's vocabulary size (read before any process group exists: a mismatch stops every rank at once)."""
    try:
        return build_tokenizer(spec).vocab_size
    except DataError as e:
        raise ConfigError(f"data.tokenizer: {e}") from None

