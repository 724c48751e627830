"""Byte sizes and capacities as users write them ("512MiB", a row count)."""

from __future__ import annotations

import re

from .errors import ConfigError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_size(value: int | str) -> int:
    """Parse a byte size like "512MiB", "4GiB", "1.5GB" or a plain int of bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise ConfigError(f"cannot parse size {value!r}; use e.g. 4096, '512MiB', '4GiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_capacity(value: int | str, row_bytes: int) -> int:
    """Turn a capacity (a row count, or a size string like "512MiB") into a row count."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"capacity must be a row count or a size string, got {value!r}")
    rows = value if isinstance(value, int) else parse_size(value) // max(row_bytes, 1)
    if rows < 0:
        raise ConfigError(f"capacity must be >= 0, got {value!r}")
    return rows


def parse_map_limit(value: int | str | None) -> int | None:
    """Parse a map limit: None (no cap) or a positive byte size."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"map_limit must be a byte size or None, got {value!r}")
    size = parse_size(value)
    if size <= 0:
        raise ConfigError(f"map_limit must be a positive byte size or None, got {value!r}")
    return size
