"""The `tierstore` console command: inspect stores, run the demo and the policy benchmark."""

from __future__ import annotations

import argparse
import json
import sys

from .backends.lmdb_backend import LmdbBackend
from .config import TableSpec
from .errors import TierstoreError
from .store import LAST_OPEN

# library keyword arguments named in error messages -> this command's flags
_FLAG_NAMES = {"overwrite=True": "--overwrite", "map_limit": "--map-limit"}


def _info(args: argparse.Namespace) -> int:
    report = store_info(args.path)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"store {report['path']}  format v{report['format_version']}  seed {report['seed']}")
    print(f"disk: {report['disk_bytes'] / 2**20:.1f} MiB")
    print(f"{'table':<20} {'num_rows':>16} {'dim':>5} {'dtype':>9} {'optimizer':>16} {'rows stored':>12}")
    for t in report["tables"]:
        print(f"{t['name']:<20} {t['num_rows']:>16} {t['dim']:>5} {t['dtype']:>9} "
              f"{t['optimizer']['kind']:>16} {t['rows_stored']:>12}")
    print("\nhyperparameters (stored at creation; TierStore.open uses these):")
    for t in report["tables"]:
        print(f"  {t['name']}: optimizer {_kv(t['optimizer'])}; init {_kv(t['init'])}")
        if t.get("last_open"):
            last = t["last_open"]
            print(f"  {'':{len(t['name'])}}  last opened with: optimizer {_kv(last['optimizer'])}; "
                  f"init {_kv(last['init'])}")
    print(f"\nopen it with: TierStore.open({str(report['path'])!r})  "
          f"(= TierStore(path, tables, seed={report['seed']}) with the stored specs)")
    return 0


def _kv(cfg: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in cfg.items())


def store_info(path: str) -> dict:
    """What `tierstore info` reports: format, seed, sizes, each table's specs and last-open specs."""
    backend = LmdbBackend(path, readonly=True)
    try:
        store = backend.get_meta("store") or {}
        last_open = backend.get_meta(LAST_OPEN) or {}
        tables = [TableSpec.from_config(backend.get_meta(k)) for k in sorted(backend.meta_keys())
                  if k.startswith("table:")]
        report = {
            "path": str(path),
            "format_version": store.get("format_version"),
            "seed": store.get("seed"),
            "disk_bytes": backend.disk_bytes(),
            "map_used_bytes": backend.used_bytes(),
            "tables": [],
        }
        for t in tables:
            cfg = t.to_config()
            last = last_open.get(t.name)
            report["tables"].append({**cfg, "rows_stored": backend.count(t.name),
                                     "payload_floats": t.payload_dim,
                                     "last_open": last if last not in (None, cfg) else None})
    finally:
        backend.close()
    return report


def _forwarded() -> dict[str, tuple[str, str]]:
    """Subcommands that forward every argument to a module's `main(argv, prog)`: (module, help)."""
    return {
        "bench-policies": ("tierstore.sim.bench", "miss ratios of cache policies on a trace, and sizing"),
        "demo": ("tierstore.demo", "exercise a store on a 10**11-row table and print its stats"),
    }


def _upgrade(args: argparse.Namespace) -> int:
    from .backends.upgrade import upgrade_store
    from .store import FORMAT_VERSION

    report = upgrade_store(args.path)
    state = f"converted {report['rows']} rows" if report["upgraded"] else \
        f"already at format {FORMAT_VERSION}"
    print(f"{report['path']}: {state}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from .distributed.repartition import export_sharded, sharded_plan_of
    from .export import export_store

    if args.dtype != "float32":
        from .quantize import export_quantized

        m = export_quantized(args.src, args.dest, args.dtype, overwrite=args.overwrite)
        for t in m["tables"]:
            print(f"{t['name']}: {t['rows']} rows, {t['bytes_per_row']} bytes/row "
                  f"({t['float32_bytes_per_row']} as float32)")
        print(f"exported {args.dtype} weights to {args.dest}: {m['bytes'] / 2**20:.1f} MiB "
              f"in {m['seconds']:.1f} s")
        return 0

    sharded = sharded_plan_of(args.src) is not None  # every shard of a sharded store/checkpoint
    m = (export_sharded if sharded else export_store)(
        args.src, args.dest, level=args.level, shuffle=not args.no_shuffle,
        shard_bytes=args.shard_size, overwrite=args.overwrite)
    rows = sum(t["rows"] for t in m["tables"])
    print(f"exported {rows} rows of {len(m['tables'])} tables to {args.dest}: "
          f"{m['raw_bytes'] / 2**20:.1f} MiB raw -> {m['bytes'] / 2**20:.1f} MiB "
          f"({m['raw_bytes'] / max(m['bytes'], 1):.2f}x) in {m['seconds']:.1f} s")
    return 0


def _import(args: argparse.Namespace) -> int:
    from .export import import_store

    if args.world_size is not None:  # re-partitioned into one shard store per rank
        from .distributed.repartition import import_sharded

        m = import_sharded(args.src, args.path, args.world_size, sharding=args.sharding,
                           map_limit=args.map_limit)
    else:
        m = import_store(args.src, args.path, map_limit=args.map_limit)
    rows = sum(t["rows"] for t in m["tables"])
    print(f"imported {rows} rows of {len(m['tables'])} tables into {args.path} "
          f"in {m['import_seconds']:.1f} s")
    return 0


def _checkpoint_verify(args: argparse.Namespace) -> int:
    from .persistence import verify_checkpoint

    m = verify_checkpoint(args.dest)
    print(f"checkpoint {args.dest} ok: step {m['step']}, seed {m['seed']}, "
          f"{sum(t['rows_stored'] for t in m['tables'])} rows in {len(m['tables'])} tables")
    return 0


def _expire(args: argparse.Namespace) -> int:
    from .expiry import expire_path

    r = expire_path(args.path, args.older_than, args.table)
    print(f"expired {sum(r['deleted'].values())} rows last updated more than {r['older_than']} "
          f"steps before clock {r['clock']} ({r['deleted']}); disk {r['bytes_before'] / 2**20:.1f} "
          f"MiB -> {r['bytes_after'] / 2**20:.1f} MiB after compaction")
    return 0


def _compact(args: argparse.Namespace) -> int:
    from .persistence import compact

    r = compact(args.path)
    print(f"compacted {r['path']}: {r['bytes_before'] / 2**20:.1f} MiB -> "
          f"{r['bytes_after'] / 2**20:.1f} MiB in {r['seconds']:.1f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `tierstore` command's parser (forwarding subcommands are listed, parsed by their module)."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="tierstore", description=__doc__, formatter_class=fmt,
                                     epilog="`tierstore COMMAND -h` shows a command's options.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    p = sub.add_parser("info", help="tables, rows stored, bytes on disk and config of a store",
                       formatter_class=fmt)
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_info)
    for name, (_, text) in _forwarded().items():
        sub.add_parser(name, help=f"{text} (all options: tierstore {name} -h)", add_help=False)
    p = sub.add_parser("export", help="portable, versioned dump of a store or checkpoint",
                       formatter_class=fmt)
    p.add_argument("src", help="store directory (not open elsewhere) or checkpoint directory")
    p.add_argument("dest")
    p.add_argument("--level", type=int, default=1, help="zstd level")
    p.add_argument("--no-shuffle", action="store_true", help="do not byte-shuffle floats")
    p.add_argument("--shard-size", default="32MiB", help="raw bytes per shard")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dest")
    p.add_argument("--dtype", choices=("float32", "int8", "int4"), default="float32",
                   help="float32: the full portable dump (weights and optimizer state); int8/int4: "
                        "row-wise quantized weights for inference (serve with a read-only store)")
    p.set_defaults(func=_export)
    p = sub.add_parser("import", help="build a new store from an export", formatter_class=fmt)
    p.add_argument("src")
    p.add_argument("path", help="a new (or empty) directory for the store")
    p.add_argument("--map-limit", default=None, help="cap on the store's size, e.g. 100GiB")
    p.add_argument("--world-size", type=int, default=None,
                   help="build a sharded store for N ranks (re-partitioned by the new plan)")
    p.add_argument("--sharding", choices=("row", "table"), default=None,
                   help="with --world-size: the plan (default: the export's, else row)")
    p.set_defaults(func=_import)
    p = sub.add_parser("checkpoint-verify", help="check a checkpoint's manifest and checksums",
                       formatter_class=fmt)
    p.add_argument("dest")
    p.set_defaults(func=_checkpoint_verify)
    p = sub.add_parser("upgrade", help="convert a closed store of on-disk format 1 or 2 to format 3",
                       formatter_class=fmt)
    p.add_argument("path")
    p.set_defaults(func=_upgrade)
    p = sub.add_parser("expire", help="delete rows not updated for K clock steps, then compact",
                       formatter_class=fmt)
    p.add_argument("path")
    p.add_argument("--older-than", type=int, required=True, metavar="K")
    p.add_argument("--table", default=None, help="only this table (default: all)")
    p.set_defaults(func=_expire)
    p = sub.add_parser("compact", help="rewrite a closed store's file in key order (smaller)",
                       formatter_class=fmt)
    p.add_argument("path")
    p.set_defaults(func=_compact)
    return parser


def cli_message(exc: BaseException) -> str:
    """An error's message with library keyword arguments replaced by this command's flags."""
    text = str(exc)
    for kwarg, flag in _FLAG_NAMES.items():
        text = text.replace(kwarg, flag)
    return text


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tierstore` command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    forwarded = _forwarded()
    if argv and argv[0] in forwarded:  # every option belongs to the wrapped module
        import importlib

        rest = argv[1:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        module = importlib.import_module(forwarded[argv[0]][0])
        return module.main(rest, prog=f"tierstore {argv[0]}")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TierstoreError as exc:
        print(f"tierstore {args.cmd}: error: {cli_message(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
