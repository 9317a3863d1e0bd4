"""Typed run configuration, one module per concern: schema.py (the sections), parse.py (files and
`--section.key value` overrides, recording the keys set), help.py (--help-config, README's table),
resolve.py (auto values), rules.py (validation; the one home of the layout rules), reads.py (the keys only
some choice reads), sharding.py (what
each ZeRO stage partitions, chosen once from zero.stage), megatron.py and
deepspeed.py (the front-ends); every check before a run starts is train/preflight.py. This package
re-exports what most callers use; the front-ends are imported by their own path (they sit higher)."""

from megazero.config.help import config_keys, markdown_table, reference, show_value
from megazero.config.parse import build_config, describe, has_key, load_yaml, parse_overrides
from megazero.config.resolve import resolve
from megazero.config.rules import validate
from megazero.config.schema import SECTIONS, Config, ConfigError, ModelConfig, OptimConfig, TrainConfig, ZeroConfig

__all__ = ["SECTIONS", "Config", "ConfigError", "ModelConfig", "OptimConfig", "TrainConfig", "ZeroConfig",
           "build_config", "config_keys", "describe", "has_key", "load_yaml", "markdown_table", "parse_overrides",
           "reference", "resolve", "show_value", "validate"]
