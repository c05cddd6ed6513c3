"""Structured JSON logs (structlog), bound with transfer_id / conversation_id by callers."""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False
#: False once ``configure`` set a level above DEBUG (structlog's own default, unconfigured,
#: emits debug lines). A debug line on a per-message path is written behind it: the
#: filtering logger would drop it, but only after the call (a lazy proxy's lookup and the
#: keyword arguments) was built, about 1 us each time.
debug_enabled = True


def configure(level: str | None = None, *, json: bool | None = None) -> None:
    """Idempotent. JSON lines on stderr by default; ``KVBATON_LOG_FORMAT=console`` for humans."""
    global _configured, debug_enabled
    if _configured:
        return
    _configured = True
    level_name = (level or os.environ.get("KVBATON_LOG_LEVEL", "INFO")).upper()
    level_no = getattr(logging, level_name, logging.INFO)
    debug_enabled = level_no <= logging.DEBUG
    use_json = json if json is not None else os.environ.get("KVBATON_LOG_FORMAT", "json") == "json"
    renderer = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
