"""Typed, validated run configuration (YAML + dotted overrides)."""

from megabam.config.loader import ConfigError, load_config, save_config
from megabam.config.schema import Config

__all__ = ["Config", "ConfigError", "load_config", "save_config"]
