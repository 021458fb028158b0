"""[loss_scaling] in a TOML: the config check rejects what Megatron's --loss-scale flags would reject, one line each."""
from __future__ import annotations

from pathlib import Path

import pytest

from titanlike.config import ConfigError, load_config


def _load(tmp_path: Path, body: str, *extra: str):
    path = tmp_path / "run.toml"
    path.write_text(f'[training]\nmixed_precision_param = "float16"\n\n[loss_scaling]\n{body}\n')
    return load_config(["--config", str(path), *extra], world_size=1)


def test_megatron_defaults_and_a_static_scale_load(tmp_path: Path) -> None:
    cfg = _load(tmp_path, "")
    assert (cfg.loss_scaling.static_scale, cfg.loss_scaling.initial_scale) == (0.0, 2.0 ** 32)
    assert (cfg.loss_scaling.min_scale, cfg.loss_scaling.window, cfg.loss_scaling.hysteresis) == (1.0, 1000, 2)
    assert _load(tmp_path, "static_scale = 128.0").loss_scaling.static_scale == 128.0


@pytest.mark.parametrize("body,message", [
    ("static_scale = -1.0", "loss_scaling.static_scale=-1.0 must be >= 0 (0 = dynamic loss scaling"),
    ("initial_scale = 0.0", "loss_scaling.initial_scale=0.0 must be a finite number > 0"),
    ("initial_scale = inf", "loss_scaling.initial_scale=inf must be a finite number > 0"),
    ("min_scale = -2.0", "loss_scaling.min_scale=-2.0 must be a finite number > 0"),
    ("min_scale = 1024.0\ninitial_scale = 512.0", "loss_scaling.min_scale=1024.0 must be <= "
                                                  "loss_scaling.initial_scale=512.0"),
    ("window = 0", "loss_scaling.window=0 must be >= 1"),
    ("hysteresis = 0", "loss_scaling.hysteresis=0 must be >= 1"),
])
def test_bad_loss_scaling_is_one_line_naming_the_key(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, body)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_override_is_checked_too(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="loss_scaling.hysteresis=-1 must be >= 1"):
        _load(tmp_path, "", "--loss_scaling.hysteresis=-1")
