"""Every config key is read somewhere: a key the code never reads is accepted, printed and saved, yet does nothing.

Checked by parsing (never importing) the library sources with `ast`. A key `section.field` counts as read when a
source under titanlike/, parallelize/, float8/ or models/ has an attribute read `.field` (on anything: the check
cannot know a variable's type, so it only catches names nothing reads at all), or the exact string "section.field"
(the tables of titanlike/config/validate.py read keys by that name). Keys kept for Megatron-flag compatibility that
only validation reads count as read. Writes (`cfg.job.run_name = ...`) do not count.
"""
from __future__ import annotations

import ast
import dataclasses
import typing
from functools import lru_cache
from pathlib import Path

import pytest

from titanlike.config.sections import JobConfig

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("titanlike", "parallelize", "float8", "models")


def config_keys() -> list[tuple[str, str]]:
    """(section, field) for every field of every section dataclass, in declaration order."""
    hints = typing.get_type_hints(JobConfig)
    return [(section.name, f.name) for section in dataclasses.fields(JobConfig)
            for f in dataclasses.fields(hints[section.name])]


@lru_cache(maxsize=None)
def reads() -> tuple[frozenset[str], frozenset[str]]:
    """(attribute names read anywhere, string constants anywhere) in the library sources."""
    attrs, strings = set(), set()
    for top in SOURCE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    attrs.add(node.attr)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    strings.add(node.value)
    return frozenset(attrs), frozenset(strings)


def unread_keys(keys: list[tuple[str, str]]) -> list[str]:
    attrs, strings = reads()
    return [f"{s}.{k}" for s, k in keys if k not in attrs and f"{s}.{k}" not in strings]


def test_the_check_sees_sections_and_unread_keys():
    keys = config_keys()  # guards the check itself: an empty walk, or one that counts everything, passes vacuously
    assert len({s for s, _ in keys}) >= 10 and ("training", "steps") in keys and ("job", "description") in keys
    assert unread_keys([("data", "zz_never_read_key"), ("training", "steps")]) == ["data.zz_never_read_key"]
    assert "checkpoint.io_threads" in reads()[1]  # validate.py's tables name keys as "section.key" strings


def test_every_config_key_is_read():
    unread = unread_keys(config_keys())
    if unread:
        lines = "\n".join(f"  {k}" for k in unread)
        pytest.fail(
            f"{len(unread)} config key(s) in titanlike/config/sections.py are never read under "
            f"{', '.join(d + '/' for d in SOURCE_DIRS)}:\n{lines}\n"
            "How to fix: read it where it takes effect (the section's attribute, e.g. cfg.training.steps, never "
            "getattr(cfg, 'key', default)), or remove it from sections.py and make titanlike/config/load.py refuse "
            "it with an error naming what replaces it (a rename error), since users' TOML files may still set it.",
            pytrace=False)
