"""Typed parsing: YAML files and `--section.key value` overrides onto the schema.

Precedence is CLI > file > defaults. Every key is typed; unknown keys and wrong types raise
`ConfigError` with one line that names the key, the value and the fix.
"""

from __future__ import annotations

import contextlib
import types
import typing
from typing import IO, Any, Callable, Literal, Optional

import yaml

from megazero.config.schema import SECTIONS, Config, ConfigError
from megazero.config.suggest import closest, key_candidates

_UNIONS = (typing.Union, types.UnionType)  # Optional[X] and the `X | None` spelling


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check `value` against a field annotation (given as a string or a type)."""
    origin = typing.get_origin(annotation)
    if origin in _UNIONS:  # Optional[X], str | None, or int | Literal["auto"]
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None and len(options) < len(typing.get_args(annotation)):
            return None
        if len(options) == 1:
            return _coerce(key, value, options[0])
        for option in options:
            try:
                return _coerce(key, value, option)
            except ConfigError:
                pass
        kinds = " or ".join(_TYPE_WORDS.get(o) or type_name(o) for o in options)
        raise ConfigError(f"{key} ({value!r}) must be {kinds}")
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{key} ({value!r}) must be one of {', '.join(map(str, choices))}")
        return value
    if annotation not in _ACCEPTED:
        raise TypeError(f"unsupported annotation {annotation} for {key}")
    if annotation is float and isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
        with contextlib.suppress(ValueError):
            value = float(value)
    if annotation is list and isinstance(value, str) and "," in value:  # --finetune.lora_targets c_attn,c_proj
        value = split_list(value)
    if annotation is list and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        value = [value]  # a single prefix given on the CLI
    if isinstance(value, bool) != (annotation is bool) or not isinstance(value, _ACCEPTED[annotation]):
        raise ConfigError(f"{key} ({value!r}) must be {_TYPE_WORDS[annotation]}")
    return annotation(value) if annotation in (float, str) else value


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}
_ACCEPTED: dict[type, type | tuple[type, ...]] = {bool: bool, int: int, float: (int, float), str: (str, int, float),
                                                  list: list}
"""The Python values a field of each type takes (true and false only for a bool field: bool is an int too)."""


def type_name(annotation: Any) -> str:
    """A field's type as --help-config shows it: int, float, bool, str, list, fp32|bf16, int|auto."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "|".join(map(str, typing.get_args(annotation)))
    if origin in _UNIONS:
        return "|".join(type_name(a) for a in typing.get_args(annotation) if a is not type(None))
    return annotation.__name__


def section_fields(section: str) -> dict[str, Any]:
    """Field name -> resolved type annotation of one section."""
    return typing.get_type_hints(SECTIONS[section])


def has_key(name: str) -> bool:
    """Is `section.key` a config key (of this version: issues add keys as they land)?"""
    section, _, key = name.partition(".")
    return section in SECTIONS and key in section_fields(section)


def check_value(name: str, value: Any, label: str) -> Any:
    """`value` typed for config key `name`; a ConfigError names it as `label` (e.g. the
    DeepSpeed key it came from)."""
    section, _, key = name.partition(".")
    return _coerce(label, value, section_fields(section)[key])


def _apply(cfg: Config, section: str, key: str, value: Any) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section '{section}'; did you mean {_nearest_key(section, key)}? "
                          f"sections are {', '.join(SECTIONS)}")
    fields = section_fields(section)
    if key not in fields:
        raise ConfigError(f"unknown config key '{section}.{key}'; did you mean {_nearest_key(section, key)}? "
                          f"{section} has {', '.join(fields)}")
    setattr(getattr(cfg, section), key, _coerce(f"{section}.{key}", value, fields[key]))


def _nearest_key(section: str, key: str) -> str:
    """The config key nearest to `section.key` (a short alias or a bare key name counts)."""
    keys = [f"{name}.{field}" for name in SECTIONS for field in section_fields(name)]
    return closest(f"{section}.{key}", key_candidates(keys, dashes=False))


def load_yaml(path: str) -> dict:
    return read_mapping(path, "config file", "YAML", yaml.safe_load,
                        "pass --config configs/gpt2-tiny.yaml or another file")


def read_mapping(path: str, what: str, syntax: str, parse: Callable[[IO], Any], hint: str) -> dict:
    """The mapping a YAML/JSON file holds; a missing, unparsable or non-mapping file is a ConfigError."""
    try:
        with open(path) as f:
            data = parse(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"{what} '{path}' does not exist; {hint}") from None
    except (yaml.YAMLError, ValueError) as e:  # ValueError: json.JSONDecodeError
        raise ConfigError(f"{what} '{path}' is not valid {syntax}: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} '{path}' must hold a mapping of keys")
    return data


def build_config(file_data: Optional[dict] = None, overrides: Optional[list[str]] = None) -> Config:
    """Defaults, then the file's sections, then CLI overrides (`--section.key value`); the keys
    either set are recorded in `cfg.set_keys`, the command line's in `cfg.cli_keys`."""
    cfg, given, cli = Config(), set(), set()
    for section, values in (file_data or {}).items():
        if not isinstance(values, dict):
            raise ConfigError(f"config section '{section}' must be a mapping of keys, got {values!r}")
        for key, value in values.items():
            _apply(cfg, section, key, value)
            given.add(f"{section}.{key}")
    for section, key, value in parse_overrides(overrides or []):
        _apply(cfg, section, key, value)
        cli.add(f"{section}.{key}")
    cfg.set_keys, cfg.cli_keys = frozenset(given | cli), frozenset(cli)
    return cfg


def parse_overrides(args: list[str]) -> list[tuple[str, str, Any]]:
    """Turn ['--a.b', '1', '--c.d=x'] into [('a', 'b', 1), ('c', 'd', 'x')] (values parsed as YAML).

    A list-typed key takes every value up to the next --flag, like Megatron's nargs='*'
    flags: `--data.prefix 0.3 A 0.7 B` is [0.3, 'A', 0.7, 'B'] (a quoted YAML list works too)."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument '{arg}'; overrides look like --section.key value")
        if "=" in arg:
            name, raw = arg[2:].split("=", 1)
            raws, i = [raw], i + 1
        else:
            name, end = arg[2:], i + 1
            while end < len(args) and not args[end].startswith("--"):
                end += 1
            if end == i + 1:
                raise ConfigError(f"override '{arg}' has no value; write {arg} VALUE")
            if not _is_list_key(name):
                end = i + 2  # one value; a stray second one is reported as an unexpected argument
            raws, i = args[i + 1:end], end
        section, key = name.split(".", 1)
        if _is_list_key(name):  # `a,b,c` is `a b c` (a YAML list `[a, b]` is parsed as one value)
            values = [v for raw in raws for v in (split_list(raw) if not raw.lstrip().startswith("[") else
                                                  [_parse_value(raw)])]
        else:
            values = [_parse_value(raw) for raw in raws]
        out.append((section, key, values[0] if len(values) == 1 else values))
    return out


def split_list(raw: str) -> list:
    """`a,b,c` as the list [a, b, c], each piece parsed as YAML (empty pieces dropped)."""
    return [_parse_value(piece.strip()) for piece in raw.split(",") if piece.strip()]


def _parse_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def _is_list_key(name: str) -> bool:
    section, _, key = name.partition(".")
    annotation = section_fields(section).get(key) if section in SECTIONS else None
    return annotation is list or list in typing.get_args(annotation)


def describe(cfg: Config) -> str:
    """The resolved config as YAML (printed once, saved with the run)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
