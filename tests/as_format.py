"""TIERSTORE_TEST_TABLE_FORMAT=btree: stores created without a `table_format` keep their tables
as B-trees (format 3, the default before page chunks were), so the whole suite runs against the
B-tree tables too; `chunks` (the default) changes nothing. `tests/conftest.py` applies it to
every test; the crash and serving workers read it too (`options`).

Tests of one format's own internals name it (`table_format="btree"`: the B-tree's pages damaged
by hand, its leaf fill, its merge order, format-2 stores built by hand; `"chunks"`: the chunk
levels' manifests, merges and deletes), so both modes pass whole (docs/testing.md)."""

from __future__ import annotations

import os
from collections.abc import Callable

DEFAULT = "chunks"  # StoreConfig.table_format's default


def wanted() -> str | None:
    """The table format TIERSTORE_TEST_TABLE_FORMAT asks for, or None (the default's)."""
    fmt = os.environ.get("TIERSTORE_TEST_TABLE_FORMAT") or None
    return None if fmt == DEFAULT else fmt


def options() -> dict[str, str]:
    """Store options that make a worker process's stores follow TIERSTORE_TEST_TABLE_FORMAT."""
    fmt = wanted()
    return {} if fmt is None else {"table_format": fmt}


def patch(setattr: Callable[[object, str, object], None] = setattr) -> None:
    """Make `StoreConfig.build` default `table_format` to the asked one."""
    from tierstore.config import StoreConfig

    fmt = wanted()
    build = StoreConfig.build.__func__

    def patched(cls, config=None, **options):
        # (a config that is no StoreConfig goes through: `build` refuses it)
        if "table_format" not in options and \
                (config is None or getattr(config, "table_format", None) == DEFAULT):
            options["table_format"] = fmt
        return build(cls, config, **options)

    setattr(StoreConfig, "build", classmethod(patched))
