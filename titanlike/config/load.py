"""TOML (+ `extends`) and command-line overrides → a checked `JobConfig`; and back to TOML for the run folder.

Every value is checked against the annotation in sections.py at the place it was written (which file, or the
command line), so an error can say where to fix it. Cross-field rules live in validate.py, not here.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
import sys
import typing
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

from titanlike.config.errors import ConfigError
from titanlike.config.sections import JobConfig
from titanlike.config.validate import advise, validate

logger = logging.getLogger("titanlike")

# Used when no --config is given: in a source checkout `python scripts/train.py` then trains the debug model.
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "debug_model.toml"

# Flags that belong to scripts, not to the config; split_flags() pulls them out before load_config() sees argv.
SCRIPT_FLAGS = ("--print-config", "--debug", "--help", "-h")

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


# ---------------------------------------------------------------------------------------------------------------
# Schema: section name -> key -> annotation, read once from the dataclasses (sections.py uses string annotations).

def _build_schema() -> dict[str, dict[str, Any]]:
    schema = {}
    for name, section_cls in typing.get_type_hints(JobConfig).items():
        schema[name] = typing.get_type_hints(section_cls)
    return schema


SCHEMA = _build_schema()
_ALL_KEYS = [f"{s}.{k}" for s, keys in SCHEMA.items() for k in keys]


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if tp is dict:
        return "table ({key = value, ...})"
    return tp.__name__


def _suggest(section: str | None, key: str, *, bare: bool = False) -> str:
    """"; did you mean 'x.y'?" for an unknown section (section=None), a key given without its section
    (bare=True), or an unknown key of a known section; "" when nothing is close."""
    if bare:
        by_name = {full.split(".", 1)[1]: full for full in reversed(_ALL_KEYS)}  # first section wins on ties
        hit = [by_name[k] for k in difflib.get_close_matches(key, list(by_name), n=1)]
    elif section is None:
        hit = difflib.get_close_matches(key, list(SCHEMA), n=1)
    else:
        # The right key in the wrong section (training.lr) is a more likely slip than a typo.
        hit = [f"{s}.{key}" for s in SCHEMA if key in SCHEMA[s]][:1]
        hit = hit or [f"{section}.{k}" for k in difflib.get_close_matches(key, list(SCHEMA[section]), n=1)]
        hit = hit or difflib.get_close_matches(f"{section}.{key}", _ALL_KEYS, n=1)
    return f"; did you mean '{hit[0]}'?" if hit else ""


def _unknown(section: str | None, key: str, where: str) -> ConfigError:
    if section is None:
        return ConfigError(f"unknown section '{key}' {where}{_suggest(None, key)}")
    return ConfigError(f"unknown key '{section}.{key}' {where}{_suggest(section, key)}")


# ---------------------------------------------------------------------------------------------------------------
# Values from TOML are already typed: check them (ints are accepted where floats are expected).

def _check_value(value: Any, tp: Any, name: str, where: str) -> Any:
    def bad() -> ConfigError:
        hint = ""
        if tp is str and isinstance(value, (bool, int, float)):  # e.g. `fused = true` for a "true" string
            hint = f'; write it as a string: {name.split(".")[-1]} = "{_toml_value(value)}"'
        return ConfigError(f"wrong type for '{name}' {where}: expected {_type_name(tp)}, "
                           f"got {value!r} ({type(value).__name__}){hint}")

    if typing.get_origin(tp) is list:
        if not isinstance(value, list):
            raise bad()
        (elem,) = typing.get_args(tp)
        return [_check_value(v, elem, f"{name}[{i}]", where) for i, v in enumerate(value)]
    if tp is dict:  # a table of plain values (model.args): its keys are checked where they are used
        if not isinstance(value, dict) or any(isinstance(v, dict) for v in value.values()):
            raise bad()
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise bad()
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad()
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad()
        return value
    raise TypeError(f"sections.py: unsupported annotation {tp!r} for {name}")  # a bug in sections.py, not the user


def _check_tree(raw: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """Check a parsed TOML document (without `extends`) against the schema; return checked values."""
    out: dict[str, dict[str, Any]] = {}
    for section, table in raw.items():
        if section not in SCHEMA:
            if not isinstance(table, dict):  # `seq_len = 8` at the top level, outside any [section]
                raise ConfigError(f"unknown top-level key '{section}' {where}: settings belong in a [section]"
                                  f"{_suggest(None, section, bare=True)}")
            raise _unknown(None, section, where)
        if not isinstance(table, dict):
            raise ConfigError(f"'{section}' {where} must be a table ([{section}]), got {table!r}")
        for key, value in table.items():
            if key not in SCHEMA[section]:
                raise _unknown(section, key, where)
            out.setdefault(section, {})[key] = _check_value(value, SCHEMA[section][key], f"{section}.{key}", where)
    return out


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:  # its message carries "(at line L, column C)"
        raise ConfigError(f"invalid TOML in {path}: {e}") from None


def _load_file(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, dict[str, Any]]:
    """Checked values of `path` merged over those of the file it extends (recursively; child wins)."""
    resolved = path.resolve()
    if resolved in chain:
        names = " -> ".join(str(p) for p in (*chain, resolved))
        raise ConfigError(f"extends cycle: {names}")
    raw = _read_toml(path)
    merged: dict[str, dict[str, Any]] = {}
    base = raw.pop("extends", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"'extends' in {path} must be a file name string, got {base!r}")
        base_path = path.parent / base  # relative to the extending file, not to the working directory
        if not base_path.is_file():
            raise ConfigError(f"{path} extends '{base}', but config file {base_path} was not found")
        merged = _load_file(base_path, (*chain, resolved))
    for section, values in _check_tree(raw, f"in {path}").items():
        merged.setdefault(section, {}).update(values)
    return merged


# ---------------------------------------------------------------------------------------------------------------
# Command line: strings, converted by the annotation.

def _parse_cli_value(text: str, tp: Any, name: str) -> Any:
    where = "on the command line"

    def bad() -> ConfigError:
        return ConfigError(f"wrong type for '{name}' {where}: expected {_type_name(tp)}, got {text!r}")

    if typing.get_origin(tp) is list:
        (elem,) = typing.get_args(tp)
        body = text.strip()
        if body.startswith("[") and body.endswith("]"):
            body = body[1:-1]
        items = [item.strip() for item in body.split(",")]
        return [_parse_cli_value(item, elem, f"{name}[{i}]") for i, item in enumerate(items) if item]
    if tp is dict:  # a TOML inline table: --model.args='{n_heads = 16}'
        try:
            value = tomllib.loads(f"v = {text.strip() or '{}'}")["v"]
        except tomllib.TOMLDecodeError:
            raise bad() from None
        return _check_value(value, tp, name, where)
    if tp is bool:
        low = text.strip().lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise bad()
    if tp in (int, float):
        try:
            return tp(text.strip())
        except ValueError:
            raise bad() from None
    if tp is str:
        s = text.strip()
        if len(s) >= 2 and s[0] == s[-1] and s[0] in "\"'":
            s = s[1:-1]
        return s
    raise TypeError(f"sections.py: unsupported annotation {tp!r} for {name}")


def _lookup(dotted: str) -> tuple[str, str]:
    where = "on the command line"
    section, dot, key = dotted.replace("-", "_").partition(".")
    if not dot:
        raise ConfigError(f"unknown command-line argument '--{dotted}' (overrides look like --section.key=value)"
                          f"{_suggest(None, section, bare=True)}")
    if section not in SCHEMA:
        raise _unknown(None, section, where)
    if key not in SCHEMA[section]:
        raise _unknown(section, key, where)
    return section, key


def _parse_argv(argv: list[str]) -> tuple[str | None, list[tuple[str, str, Any]]]:
    """Split argv into the --config path and (section, key, value) overrides, in order."""
    config: str | None = None
    overrides: list[tuple[str, str, Any]] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        if not tok.startswith("--") or tok == "--":
            raise ConfigError(f"unexpected command-line argument {tok!r} (overrides look like --section.key=value)")
        name, eq, text = tok[2:].partition("=")
        if name == "config":
            if config is not None:
                raise ConfigError(f"--config given twice ({config!r} and another); pass one file, use `extends`")
            if not eq:
                if i >= len(argv) or argv[i].startswith("--"):
                    raise ConfigError("--config needs a file: --config path/to/file.toml")
                text, i = argv[i], i + 1
            config = text
            continue
        section, key = _lookup(name)
        tp = SCHEMA[section][key]
        if not eq:
            nxt = argv[i] if i < len(argv) else None
            if tp is bool:  # a bare boolean flag means true; an explicit literal after it is consumed
                if nxt is not None and nxt.strip().lower() in _TRUE | _FALSE:
                    text, i = nxt, i + 1
                elif nxt is not None and not nxt.startswith("--"):  # meant as its value: not "unexpected argument"
                    raise ConfigError(f"--{name} takes true/false, got {nxt!r}")
                else:
                    text = "true"
            elif nxt is None or nxt.startswith("--"):
                raise ConfigError(f"--{name} needs a value: --{name}=VALUE or --{name} VALUE")
            else:
                text, i = nxt, i + 1
        overrides.append((section, key, _parse_cli_value(text, tp, f"{section}.{key}")))
    return config, overrides


# ---------------------------------------------------------------------------------------------------------------
# Public API

def split_flags(argv: list[str], flags: tuple[str, ...] = SCRIPT_FLAGS) -> tuple[list[str], set[str]]:
    """Remove script-level flags (e.g. --print-config) from argv: returns (rest, set of flags present)."""
    rest = [a for a in argv if a not in flags]
    return rest, {a for a in argv if a in flags}


def config_from_dict(values: dict[str, dict[str, Any]], where: str = "in the given dict") -> JobConfig:
    """A JobConfig with `values` ({section: {key: value}}, TOML-typed) applied over the dataclass defaults."""
    cfg = JobConfig()
    for section, table in _check_tree(values, where).items():
        for key, value in table.items():
            setattr(getattr(cfg, section), key, value)
    return cfg


def load_config(argv: list[str], *, world_size: int | None = None) -> JobConfig:
    """`--config FILE` (default: configs/debug_model.toml in a source checkout), then `--section.key[=]value`
    overrides, then validate(cfg, world_size). Raises ConfigError."""
    path, overrides = _parse_argv(list(argv))
    values: dict[str, dict[str, Any]] = {}
    if path is None and DEFAULT_CONFIG.is_file():
        path = str(DEFAULT_CONFIG)
    notes = []
    if path is not None:
        values = _load_file(Path(path))
        if not values:
            notes.append(f"config file {path} sets nothing: training {config_from_dict({}).model.name} "
                         f"{config_from_dict({}).model.flavor} on the defaults (see --print-config)")
    cfg = config_from_dict(values)
    for section, key, value in overrides:
        setattr(getattr(cfg, section), key, value)
    if not cfg.job.run_name and path is not None:
        cfg.job.run_name = Path(path).stem  # documented in sections.py: "" = the config file's stem
    validate(cfg, world_size)
    notes += advise(cfg)
    if int(os.environ.get("RANK", "0")) == 0:  # once per job, not once per rank
        for note in notes:
            logger.warning(note)
    return cfg


def config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """{section: {key: value}} with fresh lists, in the declaration order of sections.py."""
    return dataclasses.asdict(cfg)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # shortest round-tripping form: 0.001, 1e-08, 3.0
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table; keys quoted unless they are bare TOML keys
        keys = [k if k and all(c.isalnum() or c in "_-" for c in k) else json.dumps(k) for k in value]
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in zip(keys, value.values())) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def config_to_toml(cfg: JobConfig, header: str = "") -> str:
    """The whole resolved config as TOML (every key, no `extends`); load_config reads it back to an equal config."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for section, table in config_to_dict(cfg).items():
        if lines:
            lines.append("")
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in table.items())
    return "\n".join(lines) + "\n"
