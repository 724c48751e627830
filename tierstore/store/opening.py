"""Opening a store: its stored config checked, `TierStore.open`, and read-only looks at a store directory."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..backends.format import CHUNK_FORMAT
from ..backends.lmdb_backend import DATA_NAME, LmdbBackend, check_unlocked
from ..backends.pagechunks import fits as chunk_fits
from ..config import StoreConfig, TableSpec
from ..errors import (
    ConfigMismatchError,
    StoreCorruptError,
    StoreNotFoundError,
    UnknownTableError,
)
from ..resolve import DEFAULT_POLICY
from ..serving import ReadOnlyStore
from .core import FORMAT_VERSION, LAST_LAYOUT, LAST_OPEN, ROW_FORMATS

if TYPE_CHECKING:
    from .handle import TierStore


class StoreOpening:
    """TierStore's configuration: the stored specs checked against the given ones, and `open`."""

    def _check_config(self, tables: list[TableSpec], add_tables: bool = False) -> None:
        store = self.backend.get_meta("store")
        if store is None and (self.backend.log_path / DATA_NAME).exists():
            # a log is written only after its store's record: this one belongs to a store whose
            # tables are gone, and replaying it would put that store's rows into a new one
            raise StoreCorruptError(
                f"{self.path} holds a write-behind log ({self.backend.log_path.name}/) but no "
                f"store: its tables' file is gone or was replaced; restore the store from a "
                f"checkpoint, or remove {self.backend.log_path} to create a new store here")
        if store is not None:
            if store.get("format_version") not in ROW_FORMATS:  # 2 is converted after replay
                raise ConfigMismatchError(old_format_message(self.path, store.get("format_version")))
            if store.get("seed") != self.seed:
                raise ConfigMismatchError(
                    f"store {self.path} was created with seed {store.get('seed')}, given {self.seed}")
        new: dict[str, dict] = {}
        for spec in tables:
            cfg = self.backend.get_meta(f"table:{spec.name}")
            if cfg is None:
                if store is not None and not add_tables:  # a typo must not create a table for good
                    stored = sorted(k[len("table:"):] for k in self.backend.meta_keys()
                                    if k.startswith("table:"))
                    raise UnknownTableError(
                        f"store {self.path} has no table {spec.name!r}; it holds {stored} "
                        "(pass add_tables=True to add a new table)")
                new[f"table:{spec.name}"] = spec.to_config()
                continue
            problems = _mismatch(TableSpec.from_config(cfg), spec)
            if problems:
                raise ConfigMismatchError(
                    f"table {spec.name!r} in {self.path} was stored with another config: "
                    + "; ".join(problems))
        if store is None:
            chunks = self.config.table_format == "chunks"
            if chunks:
                self.backend.use_chunks()
            new["store"] = {"format_version": CHUNK_FORMAT if chunks else FORMAT_VERSION,
                            "seed": self.seed}
        # a row must fit a page-sized chunk (at most pagechunks.ROW_WORDS_MAX words with the
        # optimizer's state): a wider table of a chunked store stays a B-tree (its `t:` database
        # records it), whether the store's format was asked for or the default
        self.backend.keep_as_btree([s.name for s in tables if not chunk_fits(4 * s.row_dim + 4)])
        old = self.backend.get_meta(LAST_OPEN) or {}  # each table's specs at its latest open
        last = {**old, **{t.name: t.to_config() for t in tables}}
        if last != old:
            new[LAST_OPEN] = last
        layout = self.layout.as_dict()  # what this open resolved, for `tierstore info`
        if self.backend.get_meta(LAST_LAYOUT) != layout:
            new[LAST_LAYOUT] = layout
        if new:
            self.backend.put_meta(new)
            self.backend.sync()

    @classmethod
    def open(cls, path: str | os.PathLike, *, readonly: bool = False,
             config: StoreConfig | None = None, **options: Any) -> TierStore | ReadOnlyStore:
        """Open an existing store with its recorded table specs and seed (`StoreNotFoundError` if none).

        `config` / `options` are `StoreConfig` fields (the seed is the stored one). `readonly=True`
        returns a `tierstore.serving.ReadOnlyStore` (any process, while a writer has the store
        open; only `host_capacity`, `policy` and `device` apply). `host_capacity` defaults to
        512MiB for a writer and 64MiB (weights only) for a read-only handle. A writer's cache
        layout is resolved as `TierStore`'s is (`tierstore.resolve`).
        """
        host = options.pop("host_capacity", None)
        if host is None and config is not None:
            host = config.host_capacity
        if readonly:  # a serving handle on the writer's last flush: docs/serving.md
            cfg = StoreConfig.build(config, **options)
            return _open_readonly(path, "64MiB" if host is None else host,
                                  DEFAULT_POLICY if cfg.policy is None else cfg.policy, cfg.device)
        specs, seed = stored_config(path)
        options.pop("seed", None)  # the stored seed: a store's lazy rows depend on it
        cfg = StoreConfig.build(config, **options, host_capacity="512MiB" if host is None else host,
                                seed=seed)
        return cls(path, specs, config=cfg)


def _mismatch(stored: TableSpec, given: TableSpec) -> list[str]:
    """Fields that make a stored table incompatible with the given spec."""
    out = []
    for field in ("num_rows", "dim", "dtype"):
        if getattr(stored, field) != getattr(given, field):
            out.append(f"{field}: stored {getattr(stored, field)!r}, given {getattr(given, field)!r}")
    if stored.optimizer.kind != given.optimizer.kind:
        out.append(f"optimizer: stored {stored.optimizer.kind!r}, given {given.optimizer.kind!r}")
    if stored.init != given.init:
        out.append(f"init: stored {stored.init!r}, given {given.init!r}")
    if stored.admission != given.admission:
        out.append(f"admission: stored {stored.admission!r}, given {given.admission!r}")
    return out


def _open_readonly(path: str | os.PathLike, host_capacity: int | str, policy: str,
                   device: torch.device | str | None) -> ReadOnlyStore:
    """`TierStore.open(path, readonly=True)`: a ReadOnlyStore on the store or quantized export."""
    if not (Path(path) / DATA_NAME).is_file():
        raise StoreNotFoundError(f"no tierstore store at {path} (no {DATA_NAME})")
    return ReadOnlyStore(path, host_capacity=host_capacity, policy=policy, device=device)


def old_format_message(path: str | os.PathLike, version: object) -> str:
    """The error text for a store written in another on-disk format version."""
    if version == 1:
        return (f"store {path} has on-disk format version 1 (rows without checksums and stamps); "
                f"this tierstore reads version {FORMAT_VERSION}. Convert it in place with "
                f"`tierstore upgrade {path}` (the store must be closed)")
    return (f"store {path} has on-disk format version {version!r}; this tierstore reads version "
            f"{FORMAT_VERSION}")


def stored_config(path: str | os.PathLike) -> tuple[list[TableSpec], int]:
    """The table specs (creation order of names aside) and seed recorded in a store directory."""
    p = Path(path)
    if not (p / DATA_NAME).is_file():
        raise StoreNotFoundError(f"no tierstore store at {p} (no {DATA_NAME}); "
                                 "create one with TierStore(path, tables)")
    check_unlocked(p)  # open in this process too: StoreLockedError, as TierStore(path, specs) gives
    backend = LmdbBackend(p, readonly=True)
    try:
        store = backend.get_meta("store")
        specs = [TableSpec.from_config(backend.get_meta(k)) for k in backend.meta_keys()
                 if k.startswith("table:")]
    finally:
        backend.close()
    if store is None or not specs:
        raise StoreNotFoundError(f"{p} holds LMDB data but no tierstore tables")
    return specs, int(store["seed"])


def open_tables(path: str | os.PathLike) -> Iterable[TableSpec]:
    """The table specs stored in a store directory (read-only; no lock taken)."""
    backend = LmdbBackend(path, readonly=True)
    try:
        return [TableSpec.from_config(backend.get_meta(k)) for k in backend.meta_keys()
                if k.startswith("table:")]
    finally:
        backend.close()
