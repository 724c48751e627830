"""Operations on a closed store that open it whole: the `tierstore expire` command's work."""

from __future__ import annotations

from collections.abc import Callable

from .backends.lmdb_backend import LmdbBackend
from .expiry import check_older_than
from .persistence import compact
from .store import TierStore, open_tables


def expire_path(path: str, older_than: int, table: str | None = None,
                progress: Callable[[int], None] | None = None) -> dict:
    """`tierstore expire`: open a closed store, expire its old rows, close it (compacting).

    `progress` gets the rows the final compaction copied after each chunk.
    """
    older_than = check_older_than(older_than)
    specs = list(open_tables(path))
    meta = LmdbBackend(path, readonly=True)
    try:
        seed = int((meta.get_meta("store") or {}).get("seed", 0))
    finally:
        meta.close()
    with TierStore(path, specs, seed=seed, device="cpu", device_capacity=0,
                   host_capacity=0) as store:
        before = store.backend.disk_bytes()
        deleted = store.expire(table, older_than)
        clock = store.clock
    sizes = compact(path, progress)
    return {"path": str(path), "clock": clock, "older_than": older_than, "deleted": deleted,
            "bytes_before": before, "bytes_after": sizes["bytes_after"]}
