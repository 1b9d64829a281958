"""structlog setup: human-readable on a terminal, JSON lines otherwise."""

from __future__ import annotations

import logging
import sys

import structlog

from runtime.config import LoggingConfig


def configure_logging(config: LoggingConfig) -> None:
    renderer = _renderer(config.format)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[config.level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def _renderer(fmt: str):
    if fmt == "console" or (fmt == "auto" and sys.stderr.isatty()):
        return structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    return structlog.processors.JSONRenderer()
