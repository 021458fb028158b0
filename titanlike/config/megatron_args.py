"""`scripts/train.py --megatron-args "<pretrain_gpt.py flags>"`: train straight from a Megatron-LM flag block.

The block goes through the same translator as scripts/from_megatron.py (titanlike/config/megatron.py); the TOML it
makes is loaded as if it were given with --config, so titanlike overrides (--section.key=value) on the same command
line win over it, and a --config FILE given too becomes the TOML's `extends` base (the flags win over that file).
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from titanlike.config.errors import ConfigError
from titanlike.config.load import _toml_value, load_config
from titanlike.config.megatron import Translation, to_toml, translate_text
from titanlike.config.sections import JobConfig

FLAG = "--megatron-args"
USAGE = (f'{FLAG} takes the whole flag block as one argument: {FLAG} "--num-layers 24 --hidden-size 1024 ..." '
         f"or {FLAG} @flags.sh (a file); titanlike overrides (--section.key=value) may follow it")


@dataclass
class MegatronRun:
    block: str  # the flag block as given
    translation: Translation
    toml: str  # what was loaded: the translated TOML (with its # note / # unmapped lines)


def take_block(argv: list[str]) -> tuple[list[str], str | None]:
    """Remove `--megatron-args BLOCK`, `--megatron-args=BLOCK` or `--megatron-args @FILE` from argv: (rest, block).
    One argument, because Megatron flags and titanlike overrides both start with "--": a block running to the end of
    the command line would swallow the overrides."""
    rest, block = [], None
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        if tok != FLAG and not tok.startswith(FLAG + "="):
            rest.append(tok)
            continue
        if block is not None:
            raise ConfigError(f"{FLAG} given twice; put all the flags in one block")
        if tok == FLAG:
            if i >= len(argv):
                raise ConfigError(f"{FLAG} needs the flag block: {USAGE}")
            tok, i = argv[i], i + 1
        else:
            tok = tok[len(FLAG) + 1:]
        block = _read_file(tok[1:]) if tok.startswith("@") else tok
    if block is not None:
        for tok in rest:  # a Megatron flag outside the block: the block was not quoted
            name = tok.partition("=")[0]
            if name.startswith("--") and "." not in name and name != "--config":
                raise ConfigError(f"{tok} comes after the flag block: {USAGE}")
    return rest, block


def _read_file(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{FLAG} @{path}: cannot read the flag file ({e.strerror or e})") from None


def _pop_config(argv: list[str]) -> tuple[list[str], str | None]:
    rest, config = [], None
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        if tok == "--config" and i < len(argv):
            config, i = argv[i], i + 1
        elif tok.startswith("--config="):
            config = tok.partition("=")[2]
        else:
            rest.append(tok)
    return rest, config


def load_with_megatron_args(argv: list[str], block: str, world_size: int | None) -> tuple[JobConfig, MegatronRun]:
    """Translate `block`, refuse it when a flag it cannot map changes what is trained (MegatronError from the
    translator for contradictions; ConfigError here), and load it under the rest of argv as load_config would."""
    t = translate_text(block)
    needed = t.required()
    if needed:
        flag, why = needed[0]
        more = f" (also unmapped and needed: {', '.join(f for f, _ in needed[1:])})" if len(needed) > 1 else ""
        raise ConfigError(f"{FLAG}: {flag}: {why}{more}; translate with scripts/from_megatron.py and edit the TOML")
    argv, config = _pop_config(argv)
    toml = to_toml(t, header=f"Translated from {FLAG} by scripts/train.py (the same code as scripts/from_megatron.py)")
    if config is not None:  # the translated keys over the given config: `extends` must come before any [table]
        head, _, tail = toml.partition("\n")
        toml = f"{head}\nextends = {_toml_value(str(Path(config).resolve()))}\n{tail}"
        if not Path(config).is_file():
            raise ConfigError(f"config file not found: {config}")
    with tempfile.TemporaryDirectory(prefix="titanlike-megatron-") as tmp:
        path = Path(tmp) / "megatron.toml"  # its stem is the run name unless job.run_name / --wandb-exp-name says
        path.write_text(toml)
        cfg = load_config(["--config", str(path), *argv], world_size=world_size)
    return cfg, MegatronRun(block, t, toml)

