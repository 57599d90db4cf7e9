"""What a timeout may be, and the one a request gets. A leaf (the scheduling core's errors
only): the API's conversion and the CLI flags check timeouts without the engine."""

from __future__ import annotations

import math
from typing import Any

from scheduler_svc.core.errors import ValidationError

__all__ = ["MAX_TIMEOUT_S", "check_timeout", "request_timeout"]

# Longer than any generation, short enough that `arrival + timeout` stays an exact float and a
# typo (a timeout in milliseconds, say) is refused rather than meaning "never".
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def check_timeout(value: float, what: str = "timeout_s") -> float:
    """`value` if it is a usable timeout in seconds, else ValidationError saying why."""
    if not math.isfinite(value) or value <= 0:
        raise ValidationError(f"{what} must be a positive number of seconds, got {value}")
    if value > MAX_TIMEOUT_S:
        raise ValidationError(f"{what} must be at most {MAX_TIMEOUT_S:.0f} seconds, got {value}")
    return value


def request_timeout(inp: Any, server_default_s: float | None) -> float | None:
    """Seconds from arrival the request may take: the shortest of its own timeouts
    (``GenerateInput.timeouts``) and the server's default; None when there is none."""
    given = [t for t in (server_default_s, *inp.timeouts) if t is not None]
    return min(given) if given else None
