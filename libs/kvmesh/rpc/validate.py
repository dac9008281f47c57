"""Input validation helpers for servicers: each failure raises `InvalidArgument` naming the field."""

from __future__ import annotations

import math
from collections.abc import Sized

from kvmesh.core.errors import InvalidArgument


def require(condition: bool, field: str, message: str) -> None:
    """Raises InvalidArgument(field, message) unless `condition` holds."""
    if not condition:
        raise InvalidArgument(field, message)


def non_empty(value: str | Sized, field: str) -> None:
    """The field must be present and non-empty."""
    require(len(value) > 0, field, "must not be empty")


def in_range(value: float, field: str, lo: float | None = None, hi: float | None = None) -> None:
    """lo <= value <= hi (either bound optional); NaN and infinities are rejected."""
    require(math.isfinite(value), field, f"must be a finite number, got {value}")
    if lo is not None:
        require(value >= lo, field, f"must be >= {lo}, got {value}")
    if hi is not None:
        require(value <= hi, field, f"must be <= {hi}, got {value}")


def max_len(value: str | Sized, field: str, limit: int) -> None:
    """At most `limit` items/characters."""
    require(len(value) <= limit, field, f"must have at most {limit} items, got {len(value)}")
