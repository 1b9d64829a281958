"""What `mlxrt`'s subcommand modules share: the exit codes (said in `tools.cli`), the `--config`
option and `--model`'s override."""

from __future__ import annotations

import argparse

import msgspec

from runtime.config import RuntimeConfig

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_REJECTED = 0, 1, 2, 3
DEFAULT_CONFIG = "configs/default.toml"


def config_arg(parser: argparse.ArgumentParser, default: str = DEFAULT_CONFIG) -> None:
    """The `--config` option, `default` when not given."""
    parser.add_argument("--config", default=default, help=f"TOML config file (default: {default})")


def with_model(config: RuntimeConfig, model: str | None) -> RuntimeConfig:
    """`config` serving `model` instead of its own (`--model`), when given."""
    return msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, path=model)) if model else config
