"""TIERSTORE_TEST_TABLE_FORMAT=chunks: stores created without a `table_format` keep their tables
as page chunks (format 4), so the whole suite can run against the chunked tables; a test of the
B-tree's own pages then fails, which says so. `tests/conftest.py` applies it to every test; the
serving tests' worker processes read it too."""

from __future__ import annotations

import os
from collections.abc import Callable


def wanted() -> str | None:
    """The table format TIERSTORE_TEST_TABLE_FORMAT asks for, or None."""
    return os.environ.get("TIERSTORE_TEST_TABLE_FORMAT") or None


def patch(setattr: Callable[[object, str, object], None] = setattr) -> None:
    """Make `StoreConfig.build` default `table_format` to the asked one."""
    from tierstore.config import StoreConfig

    fmt = wanted()
    build = StoreConfig.build.__func__

    def patched(cls, config=None, **options):
        if "table_format" not in options and (config is None or config.table_format == "btree"):
            options["table_format"] = fmt
        return build(cls, config, **options)

    setattr(StoreConfig, "build", classmethod(patched))
