"""Config: typed sections (sections.py), TOML loading with `extends` and CLI overrides (load.py), checks (validate.py).

    cfg = load_config(["--config", "configs/debug_model.toml", "--training.steps=10"], world_size=1)
    print(config_to_toml(cfg))
"""
from titanlike.config.load import (  # noqa: F401
    DEFAULT_CONFIG, ConfigError, config_from_dict, config_to_dict, config_to_toml, load_config, split_flags,
)
from titanlike.config.sections import JobConfig  # noqa: F401
from titanlike.config.validate import resolve_dp_shard, validate, validate_model  # noqa: F401

__all__ = [
    "DEFAULT_CONFIG", "ConfigError", "JobConfig", "config_from_dict", "config_to_dict", "config_to_toml",
    "load_config", "resolve_dp_shard", "split_flags", "validate", "validate_model",
]
