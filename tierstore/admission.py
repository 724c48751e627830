"""Feature admission: a row is created only once its id has been seen `min_count` times.

Counting uses a blocked count-min sketch with conservative update in a fixed number of bytes
(one 64-byte cache line per id; `depth` 8-bit saturating counters inside it). The sketch is
persisted in the store's LMDB file (named database ``s:<table>``, 64 KiB pages, zlib-compressed,
with a CRC each),
written at every `flush()`, so checkpoints, restores and compaction carry it with the rows.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from ._kernels import HAVE_NUMBA
from .errors import ConfigError, StoreCorruptError
from .fused import pool as fused_pool
from .gathered import Gathered
from .index import sorted_dedup
from .sizes import parse_size

if TYPE_CHECKING:  # pragma: no cover
    from .bagpaths import BagPaths
    from .store import TierStore, _Table
    from .traces import TraceRecorder

LINE = 64  # bytes (= 8-bit counters) per sketch line: one cache line per id
PAGE_SHIFT = 16  # sketch pages of 64 KiB are the unit of persistence
MAX_MIN_COUNT = 255  # 8-bit counters
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_STATS_KEY = b"stats"
_CRC = struct.Struct("<I")


@dataclass(frozen=True)
class Admission:
    """Base of the admission configs: which ids of a table may get a stored row."""

    kind: ClassVar[str] = ""

    def to_config(self) -> dict:
        """Serialize to a JSON-able dict (stored with the table spec)."""
        return {"kind": self.kind, **self.__dict__}


@dataclass(frozen=True)
class CountAdmission(Admission):
    """Admit an id once it has been seen `min_count` times (count-min sketch of `sketch` bytes).

    Until then reads of the id return its initializer's value and updates to it are discarded.
    """

    kind: ClassVar[str] = "count"
    min_count: int = 2
    sketch: int | str = "64MiB"
    depth: int = 4

    def __post_init__(self) -> None:
        k = self.min_count
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_MIN_COUNT:
            raise ConfigError(f"min_count must be an int in [1, {MAX_MIN_COUNT}], got {k!r}")
        d = self.depth
        if isinstance(d, bool) or not isinstance(d, int) or d not in (1, 2, 4, 8):
            raise ConfigError(f"depth must be 1, 2, 4 or 8, got {d!r}")
        if isinstance(self.sketch, bool):
            raise ConfigError(f"sketch must be a byte size, got {self.sketch!r}")
        size = parse_size(self.sketch)
        if size < 1 << PAGE_SHIFT or size > 1 << 40:
            raise ConfigError(f"sketch must be between 64KiB and 1TiB, got {self.sketch!r}")
        object.__setattr__(self, "sketch", size - size % LINE)


ADMISSIONS: dict[str, type[Admission]] = {"count": CountAdmission}


def admission_from_config(cfg: dict | None) -> Admission | None:
    """Rebuild an admission config from `to_config()` output (None stays None)."""
    if cfg is None:
        return None
    cfg = dict(cfg)
    kind = cfg.pop("kind", None)
    if kind not in ADMISSIONS:
        raise ConfigError(f"unknown admission kind {kind!r}; known: {sorted(ADMISSIONS)}")
    return ADMISSIONS[kind](**cfg)


def parse_admission(text: str) -> CountAdmission:
    """'count:K' or 'count:K:SIZE' (e.g. 'count:2', 'count:2:64MiB') -> a CountAdmission."""
    kind, _, rest = text.strip().partition(":")
    if kind != "count" or not rest:
        raise ConfigError(f"admission must look like 'count:2' or 'count:2:64MiB', got {text!r}")
    k, _, size = rest.partition(":")
    try:
        return CountAdmission(min_count=int(k), sketch=size or "64MiB")
    except ValueError as exc:
        raise ConfigError(f"bad admission {text!r}: {exc}") from exc


def fit_sketch(config: CountAdmission | None, num_rows: int) -> CountAdmission | None:
    """`config` with its sketch shrunk to at most 16 bytes per row of a small table (>= 64 KiB)."""
    if config is None:
        return None
    size = min(int(config.sketch), max(1 << PAGE_SHIFT, 16 * num_rows))
    return replace(config, sketch=size)


# sketch kernels -------------------------------------------------------------------------------
def _lines_np(ids: np.ndarray, salt: np.uint64, nlines: int, depth: int) -> np.ndarray:
    """Counter positions [n, depth] of ids: one line per id, one counter per line segment."""
    with np.errstate(over="ignore"):
        x = ids.astype(np.uint64) * _GOLDEN + salt
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        x = x ^ (x >> np.uint64(31))
        line = (x >> np.uint64(20)) % np.uint64(nlines)
        seg = LINE // depth
        r = np.arange(depth, dtype=np.uint64)
        off = r * np.uint64(seg) + ((x[:, None] >> (r * np.uint64(5))) % np.uint64(seg))
        return (line[:, None] * np.uint64(LINE) + off).astype(np.int64)


def _update_np(table: np.ndarray, dirty: np.ndarray, ids: np.ndarray, counts: np.ndarray,
               salt: np.uint64, depth: int, k: int) -> tuple[np.ndarray, int]:
    """Conservative update of sorted unique ids by their counts; returns (final counts, newly admitted)."""
    pos = _lines_np(ids, salt, table.size // LINE, depth)
    cur = table[pos]
    m = cur.min(1).astype(np.int64)
    target = np.minimum(m + counts, k).astype(np.uint8)
    raise_ = cur < target[:, None]
    if raise_.any():
        p = pos[raise_]
        np.maximum.at(table, p, np.broadcast_to(target[:, None], pos.shape)[raise_])
        dirty[np.unique(p >> PAGE_SHIFT)] = 1
    final = table[pos].min(1)
    return final, int(np.count_nonzero((m < k) & (final >= k)))


def _query_np(table: np.ndarray, ids: np.ndarray, salt: np.uint64, depth: int) -> np.ndarray:
    """Current counts (uint8) of ids."""
    return table[_lines_np(ids, salt, table.size // LINE, depth)].min(1)


if HAVE_NUMBA:
    import numba

    @numba.njit(cache=True, inline="always")
    def _line(v, salt, nlines):  # pragma: no cover - compiled
        x = np.uint64(v) * np.uint64(0x9E3779B97F4A7C15) + salt
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
        return x, np.int64((x >> np.uint64(20)) % np.uint64(nlines)) * 64

    @numba.njit(cache=True, nogil=True)
    def _update_nb(table, dirty, ids, counts, salt, depth, k, final):  # pragma: no cover
        nlines = table.size // 64
        seg = 64 // depth
        n = ids.size
        mins = np.empty(n, dtype=np.int64)
        for j in range(n):  # phase 1: every id's minimum before the batch
            x, base = _line(ids[j], salt, nlines)
            m = 255
            for r in range(depth):
                p = base + r * seg + np.int64((x >> np.uint64(5 * r)) % np.uint64(seg))
                c = np.int64(table[p])
                if c < m:
                    m = c
            mins[j] = m
        for j in range(n):  # phase 2: raise counters to min(m + count, k) (max commutes)
            m = mins[j]
            if m >= k:
                continue
            t = min(m + counts[j], k)
            x, base = _line(ids[j], salt, nlines)
            for r in range(depth):
                p = base + r * seg + np.int64((x >> np.uint64(5 * r)) % np.uint64(seg))
                if table[p] < t:
                    table[p] = np.uint8(t)
                    dirty[p >> 16] = 1
        new = 0
        for j in range(n):  # the counts after the batch
            x, base = _line(ids[j], salt, nlines)
            m = 255
            for r in range(depth):
                p = base + r * seg + np.int64((x >> np.uint64(5 * r)) % np.uint64(seg))
                c = np.int64(table[p])
                if c < m:
                    m = c
            final[j] = m
            if mins[j] < k <= m:
                new += 1
        return new

    @numba.njit(cache=True, nogil=True)
    def _query_nb(table, ids, salt, depth, out):  # pragma: no cover - compiled
        nlines = table.size // 64
        seg = 64 // depth
        for j in range(ids.size):
            x, base = _line(ids[j], salt, nlines)
            m = 255
            for r in range(depth):
                p = base + r * seg + np.int64((x >> np.uint64(5 * r)) % np.uint64(seg))
                c = np.int64(table[p])
                if c < m:
                    m = c
            out[j] = m


class CountMinSketch:
    """Blocked count-min sketch of 8-bit counters saturating at `cap`, with conservative update.

    A batch is one synchronous step: every id's minimum is read before any counter moves, then
    counters rise to min(minimum + occurrences, cap), so the result does not depend on the order
    of ids within a batch. `dirty` marks the 64 KiB pages changed since the last save.
    """

    def __init__(self, nbytes: int, depth: int, cap: int, salt: int, *, use_kernel: bool = True
                 ) -> None:
        self.table = np.zeros(nbytes, dtype=np.uint8)  # calloc: pages cost memory when touched
        self.dirty = np.zeros(-(-nbytes >> PAGE_SHIFT), dtype=np.uint8)
        self.depth = depth
        self.cap = cap
        self.salt = np.uint64(salt & 0xFFFFFFFFFFFFFFFF)
        self.use_kernel = use_kernel and HAVE_NUMBA

    @property
    def nbytes(self) -> int:
        """Bytes of counters."""
        return int(self.table.nbytes)

    def add(self, uniq: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, int]:
        """Count sorted unique ids `counts` times each; returns (counts after, ids newly at cap)."""
        if self.use_kernel:
            final = np.empty(uniq.size, dtype=np.int64)
            new = _update_nb(self.table, self.dirty, uniq, counts.astype(np.int64), self.salt,
                             self.depth, self.cap, final)
            return final, int(new)
        return _update_np(self.table, self.dirty, uniq, counts, self.salt, self.depth, self.cap)

    def query(self, ids: np.ndarray) -> np.ndarray:
        """Current counts of ids (no update)."""
        if self.use_kernel:
            out = np.empty(ids.size, dtype=np.int64)
            _query_nb(self.table, ids, self.salt, self.depth, out)
            return out
        return _query_np(self.table, ids, self.salt, self.depth).astype(np.int64)


# per-table state ------------------------------------------------------------------------------
class TableAdmission:
    """One table's admission state: the sketch, its counters, and its LMDB persistence."""

    def __init__(self, name: str, config: CountAdmission, salt: int) -> None:
        self.name = name
        self.config = config
        self.k = config.min_count
        self.sketch = CountMinSketch(int(config.sketch), config.depth, config.min_count, salt)
        self.admitted = 0  # distinct ids that reached min_count (persisted)
        self.rejected = 0  # id occurrences served as init / updates discarded (persisted)
        self.accepted = 0  # id occurrences of admitted ids (persisted)
        self._stats_dirty = False

    @property
    def dbname(self) -> bytes:
        """The LMDB database that holds this table's sketch pages."""
        return b"s:" + self.name.encode()

    def count(self, ids: torch.Tensor) -> np.ndarray | None:
        """Count every occurrence in `ids`; return the admitted mask over `ids`, or None if all are."""
        if ids.numel() == 0:
            return None
        uniq, inv, cnt = torch.unique(ids, sorted=True, return_inverse=True, return_counts=True)
        final, new = self.sketch.add(uniq.numpy(), cnt.numpy())
        self.admitted += new
        self._stats_dirty = True
        ok = final >= self.k
        if ok.all():
            self.accepted += ids.numel()
            return None
        mask = ok[inv.numpy()]
        acc = int(np.count_nonzero(mask))
        self.accepted += acc
        self.rejected += ids.numel() - acc
        return mask

    def admitted_mask(self, ids: torch.Tensor) -> np.ndarray | None:
        """Which of `ids` are admitted now (no counting), or None if all are."""
        if ids.numel() == 0:
            return None
        ok = self.sketch.query(ids.numpy()) >= self.k
        return None if ok.all() else ok

    def stats(self) -> dict:
        """Admitted ids, rejected and accepted id occurrences, and the sketch's size."""
        return {"min_count": self.k, "admitted": self.admitted, "rejected": self.rejected,
                "accepted": self.accepted, "sketch_bytes": self.sketch.nbytes}

    # persistence ----------------------------------------------------------------------------
    def load(self, backend: Any, spec: Any = None) -> None:
        """Read the persisted sketch pages and counters, checking each page's CRC.

        A table with stored rows but no sketch (e.g. built by `tierstore import`) gets every
        stored id counted `min_count` times, so no stored row is hidden.
        """
        env = backend.env
        with env.begin() as txn:
            if txn.get(self.dbname) is None:
                if spec is not None and backend.count(self.name):
                    self._seed(backend, spec)
                return
        db = backend.open_named(self.dbname, create=False)  # (GIL-safe: see open_named)
        table = self.sketch.table
        page = 1 << PAGE_SHIFT
        with env.begin(db=db) as txn:
            for key, val in txn.cursor():
                if key == _STATS_KEY:
                    try:
                        st = json.loads(bytes(val))
                        self.admitted, self.rejected = int(st["admitted"]), int(st["rejected"])
                        self.accepted = int(st.get("accepted", 0))
                        if int(st["bytes"]) != table.size:
                            raise ValueError(f"sketch of {st['bytes']} bytes, config {table.size}")
                    except (ValueError, KeyError, TypeError) as exc:
                        raise StoreCorruptError(
                            f"admission record of table {self.name!r} is unreadable: {exc}") from exc
                    continue
                idx = int.from_bytes(key, "big")
                lo = idx * page
                try:
                    body = zlib.decompress(bytes(val)[_CRC.size:])
                except zlib.error:
                    body = b""
                n = min(page, table.size - lo) if lo < table.size else -1
                if len(val) < _CRC.size or len(body) != n or \
                        _CRC.unpack_from(val)[0] != zlib.crc32(body):
                    raise StoreCorruptError(
                        f"admission sketch page {idx} of table {self.name!r} is corrupt")
                table[lo: lo + n] = np.frombuffer(body, dtype=np.uint8)

    def _seed(self, backend: Any, spec: Any) -> None:
        """Admit every row already stored (one scan, in key-order chunks)."""
        txn = backend.snapshot()
        try:
            for ids, _ in backend.iter_rows(self.name, spec.row_dim, txn):
                _, new = self.sketch.add(ids, np.full(ids.size, self.k, dtype=np.int64))
                self.admitted += new
        finally:
            txn.abort()
        self._stats_dirty = True

    def save(self, backend: Any) -> int:
        """Write the pages changed since the last save (and the counters) in one transaction."""
        dirty = np.flatnonzero(self.sketch.dirty)
        if not len(dirty) and not self._stats_dirty:
            return 0
        page = 1 << PAGE_SHIFT
        table = self.sketch.table
        backend.ensure_room(len(dirty) * (page + 4096) + 4096)
        backend.wrote = True
        env = backend.env
        db = backend.open_named(self.dbname, create=True)
        st = {"admitted": self.admitted, "rejected": self.rejected, "accepted": self.accepted,
              "bytes": int(table.size)}
        with env.begin(write=True, db=db) as txn:
            for idx in dirty.tolist():
                body = table[idx * page: (idx + 1) * page].tobytes()
                packed = zlib.compress(body, 1)  # mostly zero pages early in a stream: tiny
                txn.put(int(idx).to_bytes(4, "big"), _CRC.pack(zlib.crc32(body)) + packed)
            txn.put(_STATS_KEY, json.dumps(st).encode())
        self.sketch.dirty[dirty] = 0
        self._stats_dirty = False
        return len(dirty) * page


# store-side operations --------------------------------------------------------------------------
class AccessGate:
    """What a store counts of every access: its tables' admission (a row is admitted once its id
    was seen often enough) and the access trace, when one is recorded. A part the store owns."""

    def __init__(self, states: dict[str, TableAdmission], recorder: TraceRecorder | None) -> None:
        self.states = states  # table name -> its admission state, for tables with a config
        self.recorder = recorder

    def count(self, tab: _Table, ids: torch.Tensor) -> np.ndarray | None:
        """Count `ids` for admission; the admitted mask over them, or None when all are."""
        adm = self.states.get(tab.spec.name)
        return None if adm is None else adm.count(ids)

    def admitted(self, tab: _Table, ids: torch.Tensor) -> np.ndarray | None:
        """The admitted mask over `ids` without counting them, or None when all are."""
        adm = self.states.get(tab.spec.name)
        return None if adm is None else adm.admitted_mask(ids)

    def record(self, table: str, ids: torch.Tensor) -> None:
        """Append the requested ids to the access trace, when recording."""
        if self.recorder is not None:
            self.recorder.record(table, ids)

    def gated(self, tab: _Table) -> bool:
        """Whether the table has admission (some of its ids may not be admitted yet)."""
        return tab.spec.name in self.states

    def counts(self, tabs: list[_Table]) -> bool:
        """Whether accesses of these tables are counted (a trace, or admission on one of them)."""
        return self.recorder is not None or any(tab.spec.name in self.states for tab in tabs)

    def close(self) -> None:
        """Close the access trace, if one is recorded."""
        if self.recorder is not None:
            self.recorder.close()


def open_admission(store: TierStore) -> dict[str, TableAdmission]:
    """The admission state of every table of `store` that has an admission config, loaded."""
    out = {}
    for name, tab in store.tables.items():
        cfg = tab.spec.admission
        if cfg is not None:
            adm = TableAdmission(name, cfg, tab.key)
            adm.load(store.backend, tab.spec)
            out[name] = adm
    return out


def init_weights(device: torch.device, tab: _Table, rows: torch.Tensor) -> torch.Tensor:
    """The embedding [n, dim] a never-written row reads as (after the table's storage rounding)."""
    spec = tab.spec
    init = torch.from_numpy(spec.init(tab.key, rows.numpy(), spec.dim))
    if spec.codec.packed:
        init = spec.codec.decode(spec.codec.encode(init), spec.dim)
    return init.to(device)


def read_masked(store: TierStore, tab: _Table, ids: torch.Tensor, mask: np.ndarray) -> torch.Tensor:
    """`read` with only the `mask`ed ids admitted: the others read as their initial value."""
    keep = torch.from_numpy(mask)
    out = init_weights(store.device, tab, ids)
    if mask.any():
        idx = torch.nonzero(keep).flatten().to(store.device)
        out.index_copy_(0, idx, store.read_rows(tab, ids[keep]).to(out.dtype))
    return out


def gather_masked(paths: BagPaths, tab: _Table, ids: torch.Tensor, mask: np.ndarray) -> Gathered:
    """`gather` with only the `mask`ed ids admitted: the others get initial, uncached rows."""
    uniq, inv = sorted_dedup(ids)
    ukeep = torch.zeros(uniq.numel(), dtype=torch.bool)
    ukeep[inv] = torch.from_numpy(mask)
    weights = init_weights(paths.device, tab, uniq)
    if bool(ukeep.any()):
        sub = paths.gather_rows(tab, uniq[ukeep])
        idx = torch.nonzero(ukeep).flatten().to(weights.device)
        weights.index_copy_(0, idx, sub.weights.to(weights.device))
    return Gathered(uniq, inv, weights)


def pool_masked(paths: BagPaths, tab: _Table, ids: torch.Tensor, mask: np.ndarray,
                offsets: torch.Tensor, psw: torch.Tensor | None, mode: str
                ) -> tuple[torch.Tensor, Gathered]:
    """The module's pooled forward when some ids are not admitted (they pool their init rows)."""
    g = gather_masked(paths, tab, ids, mask)
    dim = tab.spec.dim
    if paths.fused and paths.device_tier.device.type == "cpu":
        psw = None if psw is None else psw.detach().to("cpu", torch.float32)
        w = g.weights.contiguous()
        out = fused_pool(w, torch.arange(g.unique.numel()), g.inverse, offsets, dim, psw,
                         mode == "mean")
        return out, g
    w = g.weights.to(paths.device)
    out = torch.nn.functional.embedding_bag(
        g.inverse.to(w.device), w, offsets.to(w.device), mode=mode,
        per_sample_weights=None if psw is None else psw.to(w.device, w.dtype))
    return out, g


def filter_positions(mask: np.ndarray, unique: torch.Tensor, inverse: torch.Tensor,
                     *per_position: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
    """Drop the non-admitted rows of (unique, inverse) and those positions of per-position tensors."""
    ukeep = torch.from_numpy(mask)
    remap = torch.cumsum(ukeep, 0) - 1
    pkeep = ukeep.index_select(0, inverse)
    new_inv = remap.index_select(0, inverse[pkeep])
    rest = [None if t is None else t[pkeep] for t in per_position]
    return unique[ukeep], new_inv, rest
