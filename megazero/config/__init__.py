"""Typed run configuration, one module per concern:

    schema.py     the section dataclasses and Config (what a key is, its default and its doc)
    parse.py      YAML files and `--section.key value` overrides onto the schema
    help.py       `--help-config` and README's key table, generated from the schema
    resolve.py    the auto values filled in (model.vocab_size auto, the interleaved schedule)
    rules.py      the rules a resolved config must meet, the layout rules among them (validation,
                  the planner and the process grid all call them)
    megatron.py   Megatron-LM's flags as config keys
    deepspeed.py  a DeepSpeed ds_config.json as config keys
    preflight.py  resolution and validation with the other modules' checks; --validate-only's files

This package re-exports the names most code uses (`from megazero.config import Config`); the
front-ends (megatron, deepspeed, preflight) import lower layers and are imported by their own path.
"""

from megazero.config.help import config_keys, field_docs, markdown_table, reference, show_value
from megazero.config.parse import (
    build_config,
    check_value,
    describe,
    has_key,
    load_yaml,
    parse_overrides,
    read_mapping,
    split_list,
    type_name,
)
from megazero.config.resolve import MOCK_VOCAB_SIZE, resolve, resolve_vocab_size, tokenizer_size
from megazero.config.rules import (
    nvme_path_problem,
    rampup_steps,
    schedule_warnings,
    validate,
    warmup_length,
)
from megazero.config.schema import (
    SECTIONS,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    FinetuneConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    ZeroConfig,
)

__all__ = [
    "SECTIONS", "MOCK_VOCAB_SIZE", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "FinetuneConfig",
    "LoggingConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "TrainConfig", "ZeroConfig", "build_config",
    "check_value", "config_keys", "describe", "field_docs", "has_key", "load_yaml", "markdown_table",
    "nvme_path_problem", "parse_overrides", "rampup_steps", "read_mapping", "reference", "resolve",
    "resolve_vocab_size", "schedule_warnings", "show_value", "split_list", "tokenizer_size", "type_name", "validate",
    "warmup_length",
]
