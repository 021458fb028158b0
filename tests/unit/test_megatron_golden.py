"""The translator on the seeds' pretrain_gpt.py flag blocks (tests/unit/golden_megatron/*.sh) against checked-in
TOMLs (*.toml beside them). After an intended change of the translation: UPDATE_GOLDEN=1 pytest this file, then
read the diff of the TOMLs before committing them."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from models import get_spec
from titanlike.config import ConfigError
from titanlike.config.load import load_config
from titanlike.config.megatron import parse, to_toml, tokenize, translate
from titanlike.config.validate import validate_model

GOLDEN = Path(__file__).resolve().parent / "golden_megatron"
WORLD_SIZES = {  # the world size each block is written for (its torchrun/SLURM layout)
    "gpt3_345m.sh": 1,
    "gpt2_large_tp2.sh": 4,  # tp 2 x dp 2
    "gpt3_2.7b_pattern1.sh": 8,  # tp 2 x dp 4
    "gpt_70b_pattern2.sh": 128,  # tp 8 x pp 4 x dp 4
    "gpt3_175b_tp8_pp8.sh": 256,  # tp 8 x pp 8 x dp 4
    "llama_70b_tp4_pp4.sh": 64,  # tp 4 x pp 4 x dp 4
    "llama_8b_tp2_pp2_cp2.sh": 8,
    "moe_mixtral_ep4.sh": 32,  # tp 2 x dp 16 (ep 4 borrowed from dp)
}

# Blocks whose translation titanlike cannot run yet, with the one-line reason the config check gives: MoE sizes are
# flavors of the MoE families, not flags. (The tied GPT blocks under PP run: parallelize/tied.py.)
REFUSED = {
    "moe_mixtral_ep4.sh": "gpt has no experts to shard",
}


def test_every_block_has_a_world_size() -> None:
    assert sorted(p.name for p in GOLDEN.glob("*.sh")) == sorted(WORLD_SIZES)


@pytest.mark.parametrize("name", sorted(WORLD_SIZES))
def test_translation_matches_golden_and_loads(name: str, tmp_path: Path) -> None:
    block = GOLDEN / name
    toml = to_toml(translate(parse(tokenize(block.read_text()))),
                   header=f"Golden translation of {name} (tests/unit/test_megatron_golden.py; UPDATE_GOLDEN=1 rewrites)")
    golden = block.with_suffix(".toml")
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.write_text(toml)
    assert golden.is_file(), f"no {golden.name}: run UPDATE_GOLDEN=1 pytest {Path(__file__).name}"
    assert toml == golden.read_text(), f"{name}: the translation changed; UPDATE_GOLDEN=1 to accept it"
    if name in REFUSED:
        with pytest.raises(ConfigError, match=REFUSED[name]):
            _load_and_check(golden, WORLD_SIZES[name])
    else:
        _load_and_check(golden, WORLD_SIZES[name])


def _load_and_check(golden: Path, world_size: int) -> None:
    cfg = load_config(["--config", str(golden)], world_size=world_size)
    spec = get_spec(cfg.model.name)
    args = spec.flavors[cfg.model.flavor]
    if cfg.model.n_layers > 0:
        import dataclasses
        args = dataclasses.replace(args, n_layers=cfg.model.n_layers)
    validate_model(spec, args, cfg)  # heads by tp, stages by layers
