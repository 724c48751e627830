"""Typed configuration: table specs and capacity parsing."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace

import torch

from .admission import Admission, admission_from_config
from .errors import ConfigError
from .initializers import INITIALIZERS, Initializer, UniformInit, initializer_from_config
from .optimizers import SGD, Optimizer, optimizer_from_config
from .precision import CODECS, Codec
from .sizes import parse_capacity as parse_capacity  # re-exported
from .sizes import parse_map_limit as parse_map_limit  # re-exported
from .sizes import parse_size as parse_size  # re-exported

MAX_ROWS = 2**63 - 1
DTYPES = tuple(CODECS)  # float32, float16, bfloat16 (see tierstore/precision.py)
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: its name, row count (up to 2**63-1), dim, optimizer, init and dtype.

    `dtype` is how the embedding is stored: "float32" (default, bit-exact), or "float16" /
    "bfloat16" (half the bytes; updates round stochastically; state stays float32).
    `clip`: when set, every incoming gradient value is clamped to [-clip, clip] before the
    optimizer sees it (see docs/reliability.md); None (default) leaves gradients as they are.
    """

    name: str
    num_rows: int
    dim: int
    optimizer: Optimizer = field(default_factory=SGD)
    init: Initializer = field(default_factory=UniformInit)
    dtype: str = "float32"
    clip: float | None = None
    admission: Admission | None = None  # e.g. CountAdmission(min_count=2): see docs/admission.md
    ttl: int | None = None  # expire rows not updated for this many store clock steps

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ConfigError(f"table name must match {_NAME_RE.pattern}, got {self.name!r}")
        if isinstance(self.num_rows, bool) or not isinstance(self.num_rows, int):
            raise ConfigError(f"num_rows must be an int, got {self.num_rows!r}")
        if not 1 <= self.num_rows <= MAX_ROWS:
            raise ConfigError(f"num_rows must be in [1, 2**63-1], got {self.num_rows}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or not 1 <= self.dim <= 65536:
            raise ConfigError(f"dim must be an int in [1, 65536], got {self.dim!r}")
        if not isinstance(self.optimizer, Optimizer):
            raise ConfigError(f"optimizer must be a tierstore optimizer, got {self.optimizer!r}")
        if isinstance(self.init, str):  # "uniform" / "normal" / "constant" with defaults
            if self.init not in INITIALIZERS:
                raise ConfigError(f"unknown init {self.init!r}; known: {sorted(INITIALIZERS)}")
            object.__setattr__(self, "init", INITIALIZERS[self.init]())
        if not isinstance(self.init, Initializer):
            raise ConfigError(f"init must be a tierstore initializer or its name, got {self.init!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.clip is not None and (isinstance(self.clip, bool) or
                                      not isinstance(self.clip, (int, float)) or
                                      not 0 < self.clip < float("inf")):
            raise ConfigError(f"clip must be a positive finite number or None, got {self.clip!r}")
        if self.ttl is not None and (isinstance(self.ttl, bool) or not isinstance(self.ttl, int)
                                     or not 1 <= self.ttl < 2**31):
            raise ConfigError(f"ttl must be None or an int in [1, 2**31), got {self.ttl!r}")
        if self.admission is not None and not isinstance(self.admission, Admission):
            raise ConfigError(f"admission must be a tierstore admission config, got {self.admission!r}")

    @property
    def state_dim(self) -> int:
        """Optimizer state values per row."""
        return self.optimizer.state_dim(self.dim)

    @property
    def codec(self) -> Codec:
        """How the embedding is held in the payload (float32, or packed 16-bit)."""
        return CODECS[self.dtype]

    @property
    def weight_cols(self) -> int:
        """Float32 payload columns holding the embedding (dim, or ceil(dim/2) for 16-bit)."""
        return self.codec.cols(self.dim)

    @property
    def payload_dim(self) -> int:
        """Float32 columns per row payload: embedding (packed if 16-bit) plus optimizer state."""
        return self.weight_cols + self.state_dim

    @property
    def stamp_col(self) -> int:
        """Payload column holding the row's last-update stamp (int32 bits of the store clock)."""
        return self.payload_dim

    @property
    def row_dim(self) -> int:
        """Float32 columns of a stored row: the payload, then the last-update stamp."""
        return self.payload_dim + 1

    def to_config(self) -> dict:
        """Serialize to a JSON-able dict (stored in the store's metadata)."""
        cfg = {"name": self.name, "num_rows": self.num_rows, "dim": self.dim,
               "optimizer": self.optimizer.to_config(), "init": self.init.to_config(),
               "dtype": self.dtype}
        if self.clip is not None:  # absent when unset: older stores' configs stay equal
            cfg["clip"] = float(self.clip)
        if self.admission is not None:  # absent in stores written before admission existed
            cfg["admission"] = self.admission.to_config()
        if self.ttl is not None:
            cfg["ttl"] = self.ttl
        return cfg

    @classmethod
    def from_config(cls, cfg: dict) -> TableSpec:
        """Rebuild a spec from `to_config()` output."""
        return cls(name=cfg["name"], num_rows=int(cfg["num_rows"]), dim=int(cfg["dim"]),
                   optimizer=optimizer_from_config(cfg["optimizer"]),
                   init=initializer_from_config(cfg["init"]), dtype=cfg.get("dtype", "float32"),
                   clip=cfg.get("clip"), admission=admission_from_config(cfg.get("admission")),
                   ttl=cfg.get("ttl"))


KERNELS = ("auto", "numba", "triton")
DEVICE_CACHES = ("auto", "slab", "sets")  # StoreConfig.device_cache
DAMAGED_LOG = ("raise", "last_flush")  # StoreConfig.damaged_log
TABLE_FORMATS = ("btree", "chunks")  # StoreConfig.table_format


@dataclass(frozen=True)
class StoreConfig:
    """How a store runs: cache capacities, policy, device, disk limits, buffers and kernels.

    Capacities are row counts or sizes ("512MiB"). `kernels` picks the step engine's backend:
    "auto" (numba on a CPU device tier, Triton on CUDA), "numba", or "triton" (on a CPU device
    tier it runs under Triton's interpreter, `TRITON_INTERPRET=1`). `staging_capacity`: slots past
    the cache where staged rows wait pinned (docs/prefetch.md). `write_buffer` / `write_log`: the
    write-behind ring and log (rows or sizes; None picks them from the tables). `damaged_log`:
    what an open does with a damaged write-behind log left by a crash: "raise" a
    `LogCorruptError`, or "last_flush": drop the log and open as the tables hold the rows (the
    rows written back after the last flush, which the log held, are lost).
    `policy` / `staging_capacity` None: the store resolves them and the tier split
    (`tierstore.resolve`). `device_cache`: the device tier's structure: "slab" (a slab with a
    hash index and the policy registry), "sets" (a set-associative cache whose state is tensors
    on the device, LRU or LFU; docs/design.md), or "auto": "sets" on CUDA, "slab" on the CPU.
    `table_format`: how a store created now keeps its rows on disk: "chunks" (the default:
    sorted page-sized chunks in ranges, format 4, dense on disk and merged sequentially;
    docs/persistence.md "Page-chunk tables"), or "btree" (a B-tree entry a row, format 3). A
    table whose rows do not fit a chunk (over 499 float32 words with the optimizer's state)
    stays a B-tree in a chunked store. An existing store keeps the format it was created with.
    """

    device_capacity: int | str = "64MiB"
    host_capacity: int | str = "512MiB"
    policy: str | None = None  # None: resolved for the device (tierstore.resolve)
    seed: int = 0
    device: object = None  # torch.device | str | None: CUDA when available, else the CPU
    map_limit: int | str | None = None
    record: object = None  # str | os.PathLike | None: record the access trace there
    add_tables: bool = False
    write_buffer: int | str | None = None
    write_log: int | str | None = None
    staging_capacity: int | str | None = None  # None: automatic where the layout uses them
    kernels: str = "auto"
    damaged_log: str = "raise"  # a damaged crash-left log: "raise", or "last_flush" (drop it)
    device_cache: str = "auto"  # the device tier: "slab", "sets", or "auto" (sets on CUDA)
    table_format: str = "chunks"  # a new store's tables on disk: "chunks" (format 4) or "btree" (3)

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be a non-negative int, got {self.seed!r}")
        if self.kernels not in KERNELS:
            raise ConfigError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.policy is not None and not isinstance(self.policy, str):
            raise ConfigError(f"policy must be a policy name, got {self.policy!r}")
        if not isinstance(self.add_tables, bool):
            raise ConfigError(f"add_tables must be a bool, got {self.add_tables!r}")
        parse_map_limit(self.map_limit)  # None or a positive size
        if self.device_cache not in DEVICE_CACHES:
            raise ConfigError(f"device_cache must be one of {DEVICE_CACHES}, got {self.device_cache!r}")
        if self.table_format not in TABLE_FORMATS:
            raise ConfigError(f"table_format must be one of {TABLE_FORMATS}, got {self.table_format!r}")
        if self.damaged_log not in DAMAGED_LOG:
            raise ConfigError(f"damaged_log must be one of {DAMAGED_LOG}, got {self.damaged_log!r}")

    @classmethod
    def build(cls, config: StoreConfig | None = None, **options: object) -> StoreConfig:
        """`config` (or the defaults) with `options` replacing its fields; unknown names are refused."""
        if config is not None and not isinstance(config, StoreConfig):
            raise ConfigError(f"config must be a StoreConfig, got {config!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown store option(s) {unknown}; known: {sorted(known)}")
        base = config if config is not None else cls()
        return replace(base, **options) if options else base


def resolve_device(device: torch.device | str | None) -> torch.device:
    """The torch device a store runs on: `device`, or CUDA when available, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"invalid device {device!r}: {exc}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available")
    return dev
