"""The `tierstore` console command: inspect stores, run the demo and the policy benchmark."""

from __future__ import annotations

import argparse
import json
import sys

from .backends.lmdb_backend import LmdbBackend
from .config import TableSpec
from .errors import TierstoreError


def _info(args: argparse.Namespace) -> int:
    backend = LmdbBackend(args.path, readonly=True)
    try:
        store = backend.get_meta("store") or {}
        tables = [TableSpec.from_config(backend.get_meta(k)) for k in sorted(backend.meta_keys())
                  if k.startswith("table:")]
        report = {
            "path": str(args.path),
            "format_version": store.get("format_version"),
            "seed": store.get("seed"),
            "disk_bytes": backend.disk_bytes(),
            "map_used_bytes": backend.used_bytes(),
            "tables": [{**t.to_config(), "rows_stored": backend.count(t.name),
                        "payload_floats": t.payload_dim} for t in tables],
        }
    finally:
        backend.close()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"store {report['path']}  format v{report['format_version']}  seed {report['seed']}")
    print(f"disk: {report['disk_bytes'] / 2**20:.1f} MiB")
    print(f"{'table':<20} {'num_rows':>16} {'dim':>5} {'optimizer':>16} {'rows stored':>12}")
    for t in report["tables"]:
        print(f"{t['name']:<20} {t['num_rows']:>16} {t['dim']:>5} "
              f"{t['optimizer']['kind']:>16} {t['rows_stored']:>12}")
    return 0


def _bench_policies(args: argparse.Namespace) -> int:
    from .sim.bench import main as bench_main

    return bench_main(args.rest)


def _demo(args: argparse.Namespace) -> int:
    from .demo import main as demo_main

    return demo_main(args.rest)


def _export(args: argparse.Namespace) -> int:
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

    m = export_store(args.src, args.dest, level=args.level, shuffle=not args.no_shuffle,
                     shard_bytes=args.shard_size, overwrite=args.overwrite)
    rows = sum(t["rows"] for t in m["tables"])
    print(f"exported {rows} rows of {len(m['tables'])} tables to {args.dest}: "
          f"{m['raw_bytes'] / 2**20:.1f} MiB raw -> {m['bytes'] / 2**20:.1f} MiB "
          f"({m['raw_bytes'] / max(m['bytes'], 1):.2f}x) in {m['seconds']:.1f} s")
    return 0


def _import(args: argparse.Namespace) -> int:
    from .export import import_store

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


def _compact(args: argparse.Namespace) -> int:
    from .persistence import compact

    r = compact(args.path)
    print(f"compacted {r['path']}: {r['bytes_before'] / 2**20:.1f} MiB -> "
          f"{r['bytes_after'] / 2**20:.1f} MiB in {r['seconds']:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tierstore` command."""
    parser = argparse.ArgumentParser(prog="tierstore", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="tables, rows stored, bytes on disk and config of a store")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_info)
    p = sub.add_parser("bench-policies", help="miss ratios of cache policies on a trace",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_bench_policies)
    p = sub.add_parser("demo", help="exercise a store on a 10**11-row table", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_demo)
    p = sub.add_parser("export", help="portable, versioned dump of a store or checkpoint")
    p.add_argument("src", help="store directory (not open elsewhere) or checkpoint directory")
    p.add_argument("dest")
    p.add_argument("--level", type=int, default=1, help="zstd level (default 1)")
    p.add_argument("--no-shuffle", action="store_true", help="do not byte-shuffle floats")
    p.add_argument("--shard-size", default="32MiB", help="raw bytes per shard (default 32MiB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dest")
    p.add_argument("--dtype", choices=("float32", "int8", "int4"), default="float32",
                   help="float32: the full portable dump (weights and optimizer state); int8/int4: "
                        "row-wise quantized weights for inference (serve with a read-only store)")
    p.set_defaults(func=_export)
    p = sub.add_parser("import", help="build a new store from an export")
    p.add_argument("src")
    p.add_argument("path")
    p.add_argument("--map-limit", default=None, help="cap on the store's size, e.g. 100GiB")
    p.set_defaults(func=_import)
    p = sub.add_parser("checkpoint-verify", help="check a checkpoint's manifest and checksums")
    p.add_argument("dest")
    p.set_defaults(func=_checkpoint_verify)
    p = sub.add_parser("compact", help="rewrite a closed store's file in key order (smaller)")
    p.add_argument("path")
    p.set_defaults(func=_compact)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except TierstoreError as exc:
        print(f"tierstore: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
