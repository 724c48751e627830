"""Cache access traces: synthetic generators, file readers, and the training-run recording format.

A trace is a sequence of requests, each a (table, row id) key. `load_trace(spec)` reads any
supported source; `TraceRecorder` writes the compact recording a store makes while training.

Recording format (`.tsrec`): the magic `b"TSREC\\x00\\x01\\n"`, then self-contained chunks,
each a 1-byte type and a little-endian body:

- type 1, a table name: `u16 length` + UTF-8 name; tables are numbered in order of appearance.
- type 2, a batch of ids: `u32 table, u32 count, u8 width (4 or 8), u32 nbytes` + `nbytes` of
  zlib-compressed little-endian ids (`uint32` when every id fits, else `int64`).

A truncated final chunk (a crash while recording) is ignored by the reader.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import lzma
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Self

import numpy as np
import torch

from .errors import ConfigError, StoreCorruptError

MAGIC = b"TSREC\x00\x01\n"
_T_NAME, _T_IDS = 1, 2
_IDS_HEAD = struct.Struct("<IIBI")
ORACLE_GENERAL = np.dtype([("time", "<u4"), ("obj", "<u8"), ("size", "<u4"), ("next", "<i8")])


TRACE_FORMATS = """\
trace formats (--trace):
  zipf:alpha=1.0,keys=1000000,requests=1000000,seed=0
        independent Zipf(alpha) requests over `keys` keys (popular keys scattered)
  shift:alpha=1.0,keys=1000000,requests=1000000,period=100000,drift=0,seed=0
        Zipf whose hot set moves by `drift` keys (default keys/10) every `period` requests
  FILE.npy          1-D integer keys, or [n, 2] of (table, row)
  FILE.tsrec        a recording made with TierStore(..., record=FILE.tsrec)
  *oracleGeneral*   libCacheSim oracleGeneral binary (name contains oracleGeneral)
  FILE.csv / FILE.tsv / criteo:FILE
                    Criteo rows: each of C1..C26 is a table, hex values are the ids
  FILE.jsonl        Criteo JSON lines with a `sparse` list
  FILE (other)      text, one integer key per line (`*` lines skipped), or raw integers
                    of --trace-dtype (default >i4 when the content is not text)
  any file may be .gz or .xz compressed
"""


@dataclass
class Trace:
    """A request sequence: per request a table index and a row id, plus the table names."""

    tables: np.ndarray  # int64 [n]
    rows: np.ndarray  # int64 [n]
    table_names: list[str] = field(default_factory=lambda: ["keys"])
    name: str = "trace"

    def __len__(self) -> int:
        return int(self.rows.size)

    @staticmethod
    def single(rows: np.ndarray, name: str = "trace") -> Trace:
        """A one-table trace of integer keys."""
        rows = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
        return Trace(np.zeros(rows.size, dtype=np.int64), rows, ["keys"], name)

    def dense(self) -> tuple[np.ndarray, int]:
        """Dense request ids (one per distinct (table, row) key) and the number of keys."""
        from .sim.exact import dense_keys

        if len(self.table_names) <= 1 or not self.tables.any():
            return dense_keys(self.rows)
        out = np.empty(self.rows.size, dtype=np.int64)
        offset = 0
        for t in np.unique(self.tables):
            sel = self.tables == t
            ids, n = dense_keys(self.rows[sel])
            out[sel] = ids + offset
            offset += n
        return out, offset

    def head(self, n: int) -> Trace:
        """The first `n` requests."""
        return Trace(self.tables[:n], self.rows[:n], self.table_names, self.name)


# synthetic traces ----------------------------------------------------------------------------
def _parse_params(body: str, defaults: dict[str, float]) -> dict[str, float]:
    out = dict(defaults)
    for part in filter(None, body.split(",")):
        key, eq, val = part.partition("=")
        key = key.strip()
        if not eq or key not in defaults:
            raise ConfigError(f"bad trace parameter {part!r}; known: {sorted(defaults)}")
        try:
            out[key] = float(val)
        except ValueError:
            raise ConfigError(f"trace parameter {key} must be a number, got {val!r}") from None
    return out


def zipf_ranks(n_keys: int, n: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """`n` Zipf(alpha) ranks in [0, n_keys) (rank 0 is the most popular), by inverse CDF."""
    if n_keys < 1 or n < 0 or alpha < 0:
        raise ConfigError(f"zipf needs keys >= 1, requests >= 0, alpha >= 0; got "
                          f"{n_keys}, {n}, {alpha}")
    cdf = np.cumsum(np.arange(1, n_keys + 1, dtype=np.float64) ** -alpha)
    cdf /= cdf[-1]
    out = np.empty(n, dtype=np.int64)
    chunk = 1 << 22
    for lo in range(0, n, chunk):
        u = rng.random(min(chunk, n - lo))
        out[lo:lo + u.size] = np.searchsorted(cdf, u, side="right")
    return np.minimum(out, n_keys - 1, out=out)


def _scatter(ranks: np.ndarray, n_keys: int, seed: int, shift: np.ndarray | int = 0) -> np.ndarray:
    """Map ranks to keys in [0, n_keys) with a seeded affine bijection (popular keys spread out)."""
    rng = np.random.default_rng(seed + 7919)
    a = int(rng.integers(1, max(2, n_keys)))
    while np.gcd(a, n_keys) != 1:
        a += 1
    b = int(rng.integers(0, n_keys))
    return (ranks * a % n_keys + b + shift) % n_keys


def synthetic(spec: str) -> Trace:
    """A synthetic trace from a spec string.

    `zipf:alpha=1.05,keys=10000000,requests=10000000,seed=1`: independent Zipf requests.
    `shift:alpha=1.0,keys=1000000,requests=10000000,period=1000000,drift=100000,seed=1`: Zipf
    whose hot set moves by `drift` keys every `period` requests.
    """
    kind, _, body = spec.partition(":")
    if kind == "zipf":
        p = _parse_params(body, {"alpha": 1.0, "keys": 1e6, "requests": 1e6, "seed": 0})
        n_keys, n, seed = int(p["keys"]), int(p["requests"]), int(p["seed"])
        ranks = zipf_ranks(n_keys, n, p["alpha"], np.random.default_rng(seed))
        return Trace.single(_scatter(ranks, n_keys, seed), spec)
    if kind == "shift":
        p = _parse_params(body, {"alpha": 1.0, "keys": 1e6, "requests": 1e6, "seed": 0,
                                 "period": 1e5, "drift": 0})
        n_keys, n, seed = int(p["keys"]), int(p["requests"]), int(p["seed"])
        period = max(1, int(p["period"]))
        drift = int(p["drift"]) or max(1, n_keys // 10)
        ranks = zipf_ranks(n_keys, n, p["alpha"], np.random.default_rng(seed))
        phase = np.arange(n, dtype=np.int64) // period
        return Trace.single(_scatter(ranks, n_keys, seed, phase * drift), spec)
    raise ConfigError(f"unknown synthetic trace {kind!r} in {spec!r}; use zipf: or shift:")


# file readers -------------------------------------------------------------------------------
def _open_bytes(path: Path) -> bytes:
    name = path.name.lower()
    if name.endswith((".xz", ".lzma")):
        return lzma.open(path).read()
    if name.endswith(".gz"):
        return gzip.open(path).read()
    return path.read_bytes()


def _looks_like_text(data: bytes) -> bool:
    sample = data[:4096]
    return bool(sample) and not sample.strip(b"0123456789-*+ \t\r\n")


def read_text_keys(data: bytes) -> np.ndarray:
    """Integer keys, one per line; blank lines and `*` marker lines are skipped."""
    lines = [ln for ln in data.split() if ln != b"*"]
    if not lines:
        return np.zeros(0, dtype=np.int64)
    try:
        return np.array(lines, dtype=np.int64) if len(lines) < 1000 else \
            np.loadtxt(io.BytesIO(b"\n".join(lines)), dtype=np.int64, ndmin=1)
    except ValueError as exc:
        raise ConfigError(f"text trace has a line that is not an integer: {exc}") from None


def read_raw_keys(data: bytes, dtype: str) -> np.ndarray:
    """Raw fixed-width integer keys (e.g. `>i4` big-endian int32, `>i8`)."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ConfigError(f"bad trace dtype {dtype!r}; use e.g. '>i4' or '<i8'") from None
    if dt.kind not in "iu":
        raise ConfigError(f"trace dtype must be an integer type, got {dtype!r}")
    usable = len(data) - len(data) % dt.itemsize
    return np.frombuffer(data[:usable], dtype=dt).astype(np.int64)


def read_oracle_general(data: bytes) -> np.ndarray:
    """Object ids of libCacheSim's oracleGeneral binary format (24-byte little-endian records)."""
    usable = len(data) - len(data) % ORACLE_GENERAL.itemsize
    return np.frombuffer(data[:usable], dtype=ORACLE_GENERAL)["obj"].astype(np.int64)


def write_oracle_general(path: str | Path, keys: np.ndarray) -> None:
    """Write keys as an oracleGeneral file (size 1; next-access times filled in, -1 if none)."""
    from .sim.exact import dense_keys, next_use

    keys = np.asarray(keys, dtype=np.int64)
    ids, n = dense_keys(keys)
    nxt = next_use(ids, n)
    rec = np.zeros(keys.size, dtype=ORACLE_GENERAL)
    rec["time"] = np.arange(keys.size)
    rec["obj"] = keys.astype(np.uint64)
    rec["size"] = 1
    rec["next"] = np.where(nxt >= keys.size, -1, nxt)
    Path(path).write_bytes(rec.tobytes())


def _criteo_key(value: str) -> int:
    try:
        return int(value, 16)
    except ValueError:  # not hex: a stable 63-bit hash of the string
        return int.from_bytes(zlib.crc32(value.encode()).to_bytes(4, "little") +
                              zlib.adler32(value.encode()).to_bytes(4, "little"),
                              "little") & ((1 << 63) - 1)


def read_criteo(data: bytes, delimiter: str) -> Trace:
    """Criteo rows (label, 13 integer, 26 categorical columns): each categorical column is a table.

    Requests go row by row, columns C1..C26 in order; empty categorical values are skipped.
    A header line (CSV files from DeepCTR and the like) is detected and skipped.
    """
    text = io.StringIO(data.decode("utf-8", errors="replace"))
    reader = csv.reader(text, delimiter=delimiter)
    names = [f"C{i}" for i in range(1, 27)]
    tabs: list[int] = []
    rows: list[int] = []
    first = True
    for rec in reader:
        if first:
            first = False
            if rec and rec[0].strip().lower() == "label":
                cats = [i for i, c in enumerate(rec) if c.strip().upper().startswith("C")]
                names = [rec[i].strip() for i in cats]
                start = cats[0] if cats else 14
                continue
            start = 14
        if not rec:
            continue
        if len(rec) < start + 1:
            raise ConfigError(f"Criteo row has {len(rec)} columns, expected 40")
        for t, val in enumerate(rec[start:start + len(names)]):
            if val:
                tabs.append(t)
                rows.append(_criteo_key(val))
    return Trace(np.array(tabs, dtype=np.int64), np.array(rows, dtype=np.int64), names,
                 "criteo")


def read_criteo_jsonl(data: bytes) -> Trace:
    """JSON lines with a `sparse` list of categorical ids: position i is table i."""
    tabs: list[int] = []
    rows: list[int] = []
    width = 0
    for line in data.splitlines():
        if not line.strip():
            continue
        sparse = json.loads(line)["sparse"]
        width = max(width, len(sparse))
        tabs.extend(range(len(sparse)))
        rows.extend(int(v) for v in sparse)
    return Trace(np.array(tabs, dtype=np.int64), np.array(rows, dtype=np.int64),
                 [f"C{i}" for i in range(1, width + 1)], "criteo")


def load_trace(spec: str, dtype: str | None = None, limit: int | None = None) -> Trace:
    """Load a trace from a synthetic spec or a file (format chosen by name and content).

    Files: `.npy` (1-D integer keys, or [n, 2] of (table, row)); `.tsrec` recordings;
    `.oracleGeneral[.bin]` (libCacheSim); Criteo `.csv` / `.tsv` / `.jsonl` (or `criteo:PATH`);
    otherwise text, one integer per line (`*` lines skipped), or raw integers of `dtype`
    (default `>i4` when the content is not text), optionally `.gz` / `.xz` compressed.
    """
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"trace must be a spec string or a path, got {spec!r}")
    head, _, rest = spec.partition(":")
    if head in ("zipf", "shift"):
        trace = synthetic(spec)
        return trace.head(limit) if limit is not None else trace
    force_criteo = head == "criteo"
    path = Path(rest if force_criteo else spec)
    if not path.exists():
        raise ConfigError(f"trace file not found: {path}")
    name = path.name.lower()
    for suffix in (".gz", ".xz", ".lzma"):
        name = name.removesuffix(suffix)
    if name.endswith(".npy"):
        arr = np.load(path)
        if arr.dtype.kind not in "iu":
            raise ConfigError(f"{path}: .npy trace must hold integers, got {arr.dtype}")
        if arr.ndim == 2 and arr.shape[1] == 2:
            n_tab = int(arr[:, 0].max()) + 1 if arr.size else 1
            trace = Trace(arr[:, 0].astype(np.int64), arr[:, 1].astype(np.int64),
                          [f"t{i}" for i in range(n_tab)], path.name)
        else:
            trace = Trace.single(arr.reshape(-1), path.name)
    elif name.endswith(".tsrec"):
        trace = read_recording(path)
    else:
        data = _open_bytes(path)
        if "oraclegeneral" in name:
            trace = Trace.single(read_oracle_general(data), path.name)
        elif force_criteo or name.endswith((".csv", ".tsv")):
            delim = "," if name.endswith(".csv") or (b"," in data[:4096] and b"\t" not in
                                                      data[:4096]) else "\t"
            trace = read_criteo(data, delim)
        elif name.endswith(".jsonl"):
            trace = read_criteo_jsonl(data)
        elif dtype is None and _looks_like_text(data):
            trace = Trace.single(read_text_keys(data), path.name)
        else:
            trace = Trace.single(read_raw_keys(data, dtype or ">i4"), path.name)
        trace.name = path.name
    return trace.head(limit) if limit is not None else trace


def save_npy(path: str | Path, trace: Trace) -> None:
    """Write a trace as `.npy` (1-D keys for one table, else [n, 2] of (table, row))."""
    if len(trace.table_names) <= 1:
        np.save(path, trace.rows)
    else:
        np.save(path, np.stack([trace.tables, trace.rows], axis=1))


# recording -----------------------------------------------------------------------------------
class TraceRecorder:
    """Append the (table, ids) batches a training run requests to a compact `.tsrec` file."""

    def __init__(self, path: str | Path, buffer_ids: int = 1 << 20) -> None:
        self.path = Path(path)
        self._tables: dict[str, int] = {}
        self._pending: list[tuple[int, np.ndarray]] = []
        self._pending_n = 0
        self._buffer_ids = int(buffer_ids)
        self._f: BinaryIO | None = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._f.write(MAGIC)
        self.requests = 0

    def record(self, table_name: str, ids: torch.Tensor) -> None:
        """Record a batch of row ids requested from table `table_name`, in request order."""
        if self._f is None:
            raise ConfigError("TraceRecorder is closed")
        if not isinstance(table_name, str) or not table_name:
            raise ConfigError(f"table name must be a non-empty string, got {table_name!r}")
        arr = ids.detach().reshape(-1).to("cpu").numpy() if isinstance(ids, torch.Tensor) \
            else np.asarray(ids).reshape(-1)
        if arr.dtype.kind not in "iu":
            raise ConfigError(f"ids must be integers, got dtype {arr.dtype}")
        t = self._tables.get(table_name)
        if t is None:
            t = self._tables[table_name] = len(self._tables)
            raw = table_name.encode()
            self._flush_pending()
            self._f.write(bytes([_T_NAME]) + struct.pack("<H", len(raw)) + raw)
        if arr.size:
            self._pending.append((t, arr.astype(np.int64, copy=True)))
            self._pending_n += arr.size
            self.requests += arr.size
            if self._pending_n >= self._buffer_ids:
                self._flush_pending()

    def _flush_pending(self) -> None:
        assert self._f is not None
        for t, arr in self._pending:
            small = arr.size == 0 or (int(arr.min()) >= 0 and int(arr.max()) < 1 << 32)
            body = arr.astype("<u4" if small else "<i8").tobytes()
            comp = zlib.compress(body, 1)
            self._f.write(bytes([_T_IDS]) + _IDS_HEAD.pack(t, arr.size, 4 if small else 8,
                                                           len(comp)) + comp)
        self._pending.clear()
        self._pending_n = 0

    def flush(self) -> None:
        """Write buffered batches to the file."""
        if self._f is not None:
            self._flush_pending()
            self._f.flush()

    def close(self) -> None:
        """Flush and close the file (idempotent)."""
        if self._f is not None:
            self._flush_pending()
            self._f.close()
            self._f = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_recording(path: str | Path) -> Trace:
    """Read a `.tsrec` recording into a Trace (a truncated final chunk is ignored)."""
    data = Path(path).read_bytes()
    if not data.startswith(MAGIC):
        raise StoreCorruptError(f"{path}: not a tierstore trace recording")
    names: list[str] = []
    tabs: list[np.ndarray] = []
    rows: list[np.ndarray] = []
    pos = len(MAGIC)
    while pos < len(data):
        kind = data[pos]
        if kind == _T_NAME:
            if pos + 3 > len(data):
                break
            (ln,) = struct.unpack_from("<H", data, pos + 1)
            if pos + 3 + ln > len(data):
                break
            names.append(data[pos + 3:pos + 3 + ln].decode())
            pos += 3 + ln
        elif kind == _T_IDS:
            if pos + 1 + _IDS_HEAD.size > len(data):
                break
            t, count, width, nbytes = _IDS_HEAD.unpack_from(data, pos + 1)
            start = pos + 1 + _IDS_HEAD.size
            if start + nbytes > len(data):
                break
            try:
                body = zlib.decompress(data[start:start + nbytes])
            except zlib.error:
                raise StoreCorruptError(f"{path}: corrupt chunk at byte {pos}") from None
            arr = np.frombuffer(body, dtype="<u4" if width == 4 else "<i8").astype(np.int64)
            if arr.size != count or t >= len(names):
                raise StoreCorruptError(f"{path}: inconsistent chunk at byte {pos}")
            rows.append(arr)
            tabs.append(np.full(count, t, dtype=np.int64))
            pos = start + nbytes
        else:
            raise StoreCorruptError(f"{path}: unknown chunk type {kind} at byte {pos}")
    return Trace(_cat(tabs), _cat(rows), names or ["keys"], Path(path).name)


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
