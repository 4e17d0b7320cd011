"""Switches and logging shared by every op.

Switches are environment variables read on every call, so a running job can be steered
without a restart. A malformed value never raises: it is reported once and the default
is kept.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger("kernel_fun")

_seen: set[tuple[int, str]] = set()
_seen_lock = threading.Lock()


def log_once(level: int, message: str) -> None:
    """Log ``message`` at ``level`` on the ``kernel_fun`` logger, once per distinct text."""
    key = (level, message)
    with _seen_lock:
        if key in _seen:
            return
        _seen.add(key)
    logger.log(level, message)


def reset_log_once() -> None:
    """Forget which messages were logged (tests use this to observe the next one)."""
    with _seen_lock:
        _seen.clear()


def env_flag(name: str) -> bool:
    """True when ``name`` is set to 1/true/yes/on; unset, empty or 0/false/no/off is False."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return False
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    log_once(logging.WARNING, f"ignoring {name}={raw!r}: expected 0 or 1; keeping the default (off)")
    return False


def env_int(name: str, default: int, minimum: int = 0) -> int:
    """An integer switch; a malformed or out-of-range value warns once and keeps ``default``."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        log_once(
            logging.WARNING,
            f"ignoring {name}={raw!r}: expected an integer >= {minimum}; keeping the default ({default})",
        )
        return default
    return value
