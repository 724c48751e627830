"""The `tierstore` console command: inspect stores, run the demo and the policy benchmark.

Only the commands that need torch import it: `tierstore --help`, `--version`, `info` and the help
of the commands parsed here answer without it (`python -m bench.cli_startup` times them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

from . import __version__
from .backends.lmdb_meta import LAST_LAYOUT, LAST_OPEN, read_meta
from .errors import TierstoreError

# library keyword arguments named in error messages -> this command's flags
_FLAG_NAMES = {"overwrite=True": "--overwrite", "map_limit": "--map-limit"}


def _info(args: argparse.Namespace) -> int:
    report = store_info(args.path)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    kind = {3: " (B-tree tables)", 4: " (page-chunk tables)"}.get(report["format_version"], "")
    print(f"store {report['path']}  format v{report['format_version']}{kind}  seed {report['seed']}")
    print(f"disk: {report['disk_bytes'] / 2**20:.1f} MiB")
    print(f"{'table':<20} {'num_rows':>16} {'dim':>5} {'dtype':>9} {'optimizer':>16} {'rows stored':>12} "
          f"{'format':>7}")
    for t in report["tables"]:
        print(f"{t['name']:<20} {t['num_rows']:>16} {t['dim']:>5} {t['dtype']:>9} "
              f"{t['optimizer']['kind']:>16} {t['rows_stored']:>12} {t['table_format']:>7}")
    print("\nhyperparameters (stored at creation; TierStore.open uses these):")
    for t in report["tables"]:
        print(f"  {t['name']}: optimizer {_kv(t['optimizer'])}; init {_kv(t['init'])}")
        if t.get("last_open"):
            last = t["last_open"]
            print(f"  {'':{len(t['name'])}}  last opened with: optimizer {_kv(last['optimizer'])}; "
                  f"init {_kv(last['init'])}")
    layout = report.get("layout")
    if layout:
        print(f"\nlayout at the latest open: device tier {layout['device_rows']} rows, host tier "
              f"{layout['host_rows']} rows, policy {layout['policy']}, staging slots "
              f"{layout['staging_rows']}{' (automatic reserve)' if layout['staging_auto'] else ''}")
        for reason in layout["reasons"]:
            print(f"  - {reason}")
    print(f"\nopen it with: TierStore.open({str(report['path'])!r})  "
          f"(= TierStore(path, tables, seed={report['seed']}) with the stored specs)")
    return 0


def _kv(cfg: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in cfg.items())


def store_info(path: str) -> dict:
    """What `tierstore info` reports: format, seed, sizes, each table's specs and last-open specs."""
    raw = read_meta(path)
    meta = raw["meta"]
    store = meta.get("store") or {}
    last_open = meta.get(LAST_OPEN) or {}
    report = {
        "path": str(path),
        "format_version": store.get("format_version"),
        "seed": store.get("seed"),
        "disk_bytes": raw["disk_bytes"],
        "map_used_bytes": raw["map_used_bytes"],
        "layout": meta.get(LAST_LAYOUT),  # what the latest open resolved, and why
        "tables": [],
    }
    for key in sorted(meta):
        if key.startswith("table:"):
            cfg = meta[key]
            last = last_open.get(cfg["name"])
            report["tables"].append({**cfg, "rows_stored": raw["rows"].get(cfg["name"], 0),
                                     "table_format": raw["table_formats"].get(cfg["name"], "btree"),
                                     "last_open": last if last not in (None, cfg) else None})
    return report


def _forwarded() -> dict[str, tuple[str, str]]:
    """Subcommands that forward every argument to a module's `main(argv, prog)`: (module, help)."""
    return {
        "bench-policies": ("tierstore.sim.bench", "miss ratios of cache policies on a trace, and sizing"),
        "demo": ("tierstore.demo", "exercise a store on a 10**11-row table and print its stats"),
    }


def _upgrade(args: argparse.Namespace) -> int:
    from .backends.format import FORMAT_VERSION
    from .backends.upgrade import upgrade_store

    report = upgrade_store(args.path)
    state = f"converted {report['rows']} rows" if report["upgraded"] else \
        f"already at format {FORMAT_VERSION}"
    print(f"{report['path']}: {state}")
    return 0


@contextlib.contextmanager
def _bar(args: argparse.Namespace, desc: str, total: int | None = None):
    """A tqdm progress bar on stderr (rows); yields its update function, or None with
    --no-progress."""
    if getattr(args, "no_progress", True):
        yield None
        return
    from tqdm import tqdm  # here: the help and `info` do not pay for it

    with tqdm(total=total, desc=desc, unit="row", unit_scale=True, file=sys.stderr,
              dynamic_ncols=True) as bar:
        yield bar.update


def _rows_in(path: str) -> int | None:
    """Rows stored in a store or checkpoint directory (for a bar's total), None if unknown."""
    try:
        rows = sum(read_meta(path)["rows"].values())
    except (TierstoreError, OSError):
        return None
    return rows or None  # none yet in the tables: rows may still be in the write-behind log


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
    opts = dict(level=args.level, shuffle=not args.no_shuffle, shard_bytes=args.shard_size,
                overwrite=args.overwrite)
    if sharded:
        m = export_sharded(args.src, args.dest, **opts)
    else:
        with _bar(args, "export", _rows_in(args.src)) as progress:
            m = export_store(args.src, args.dest, **opts, progress=progress)
    rows = sum(t["rows"] for t in m["tables"])
    print(f"exported {rows} rows of {len(m['tables'])} tables to {args.dest}: "
          f"{m['raw_bytes'] / 2**20:.1f} MiB raw -> {m['bytes'] / 2**20:.1f} MiB "
          f"({m['raw_bytes'] / max(m['bytes'], 1):.2f}x) in {m['seconds']:.1f} s")
    return 0


def _import(args: argparse.Namespace) -> int:
    from .export import import_store, read_export_manifest

    if args.world_size is not None:  # re-partitioned into one shard store per rank
        from .distributed.repartition import import_sharded

        m = import_sharded(args.src, args.path, args.world_size, sharding=args.sharding,
                           map_limit=args.map_limit, table_format=args.table_format)
    else:
        try:
            total = sum(int(t["rows"]) for t in read_export_manifest(args.src)["tables"])
        except (TierstoreError, KeyError, TypeError, ValueError):
            total = None  # import_store reports what is wrong with the export
        with _bar(args, "import", total) as progress:
            m = import_store(args.src, args.path, map_limit=args.map_limit, progress=progress,
                             table_format=args.table_format)
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


def _verify(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .verify import expected_work, verify_store

    pages, rows = expected_work(args.path)
    with tqdm(total=pages, desc="pages", unit="page", disable=args.no_progress) as pbar, \
            tqdm(total=rows, desc="rows", unit="row", unit_scale=True,
                 disable=args.no_progress) as rbar:
        r = verify_store(args.path, pbar.update, rbar.update)
    print(f"store {r['path']} ok: {r['pages']} pages, {sum(r['rows'].values())} rows in "
          f"{len(r['rows'])} tables checked" + (f"; a crash-left log of {r['log_pages']} pages"
                                                 if r["log_pages"] else ""))
    return 0


def _expire(args: argparse.Namespace) -> int:
    from .offline import expire_path

    with _bar(args, "expire, then compact", _rows_in(args.path)) as progress:
        r = expire_path(args.path, args.older_than, args.table, progress=progress)
    print(f"expired {sum(r['deleted'].values())} rows last updated more than {r['older_than']} "
          f"steps before clock {r['clock']} ({r['deleted']}); disk {r['bytes_before'] / 2**20:.1f} "
          f"MiB -> {r['bytes_after'] / 2**20:.1f} MiB after compaction")
    return 0


def _compact(args: argparse.Namespace) -> int:
    from .persistence import compact

    with _bar(args, "compact", _rows_in(args.path)) as progress:
        r = compact(args.path, progress=progress)
    print(f"compacted {r['path']}: {r['bytes_before'] / 2**20:.1f} MiB -> "
          f"{r['bytes_after'] / 2**20:.1f} MiB in {r['seconds']:.1f} s")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from .distributed.planner import CostModel, auto_plan, format_report, plan_tables

    tables, lookups = plan_tables(args.config)
    for item in args.lookups or []:
        name, _, value = item.partition("=")
        ids, _, bags = value.partition(":")
        lookups[name] = (float(ids), float(bags or ids))
    model = CostModel(lookup_rate=args.lookup_rate, bandwidth=args.bandwidth,
                      id_bytes=8 if args.int64_ids else 4, float_bytes=2 if args.half else 4)
    plan, report = auto_plan(tables, args.world_size, lookups, args.budget, model)
    if args.json:
        print(json.dumps({"plan": plan.to_config(), "model": report.to_config()}, indent=2))
    else:
        print(format_report(plan, report))
    return 0


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Shows an option's default once: unless its help already says it, or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or \
                not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _command(sub: Any, name: str, summary: str, description: str,
             func: Any) -> argparse.ArgumentParser:
    """A subcommand of `sub` (the parser's subparsers action) with its one-line summary (in
    `tierstore --help`) and its description."""
    p = sub.add_parser(name, help=summary, description=f"{summary[0].upper()}{summary[1:]}.\n\n"
                       f"{description}", formatter_class=_Formatter)
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The `tierstore` command's parser (forwarding subcommands are listed, parsed by their module)."""
    parser = argparse.ArgumentParser(prog="tierstore", description=__doc__, formatter_class=_Formatter,
                                     epilog="`tierstore COMMAND -h` shows a command's options.")
    parser.add_argument("--version", action="version", version=f"tierstore {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    p = _command(sub, "info", "tables, rows stored, bytes on disk and config of a store",
                 "Reads the store's metadata only (no rows), so it is safe beside a live store.",
                 _info)
    p.add_argument("path", help="the store's directory")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    for name, (_, text) in _forwarded().items():
        sub.add_parser(name, help=f"{text} (all options: tierstore {name} -h)", add_help=False)
    p = _command(sub, "export", "portable, versioned dump of a store or checkpoint",
                 "Writes zstd-compressed shards and a checksummed manifest; `tierstore import`\n"
                 "builds a new store from it. The source must not be open for writing elsewhere.",
                 _export)
    p.add_argument("src", help="store directory (not open elsewhere) or checkpoint directory")
    p.add_argument("dest", help="a new directory for the export")
    p.add_argument("--level", type=int, default=1, help="zstd level, 1-22")
    p.add_argument("--no-shuffle", action="store_true", help="do not byte-shuffle floats")
    p.add_argument("--shard-size", default="32MiB", help="raw bytes per shard")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dest")
    p.add_argument("--dtype", choices=("float32", "int8", "int4"), default="float32",
                   help="float32: the full portable dump (weights and optimizer state); int8/int4: "
                        "row-wise quantized weights for inference (serve with a read-only store)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p = _command(sub, "import", "build a new store from an export",
                 "Verifies every shard's checksum; the store appears at PATH only once complete.",
                 _import)
    p.add_argument("src", help="an export directory (from `tierstore export`)")
    p.add_argument("path", help="a new (or empty) directory for the store")
    p.add_argument("--map-limit", default=None, help="cap on the store's size, e.g. 100GiB "
                   "(default: no cap)")
    p.add_argument("--table-format", choices=("chunks", "btree"), default=None,
                   help="the new store's tables on disk: page-chunk levels (format 4, the "
                        "default; a table too wide for a chunk stays a B-tree) or B-trees "
                        "(format 3); docs/persistence.md")
    p.add_argument("--world-size", type=int, default=None,
                   help="build a sharded store for N ranks (re-partitioned by the new plan)")
    p.add_argument("--sharding", choices=("row", "table"), default=None,
                   help="with --world-size: the plan (default: the export's, else row)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p = _command(sub, "plan", "the cost-model sharding plan of a table config for N ranks",
                 "What `ShardedTierStore(..., sharding=\"auto\")` would choose: each table table-,\n"
                 "row-, column-wise or data-parallel, and every rank's modeled compute, bytes moved,\n"
                 "memory and step time (formula: docs/distributed.md).", _plan)
    p.add_argument("config", help="a JSON file: a list of table specs ({name, num_rows, dim, "
                   "optimizer?}) or {\"tables\": [...], \"lookups\": {table: ids or [ids, bags]}}")
    p.add_argument("--world-size", type=int, required=True, help="number of ranks")
    p.add_argument("--budget", default=None, help="bytes of rows per rank, e.g. 8GiB (default: "
                   "no limit)")
    p.add_argument("--lookups", nargs="*", metavar="TABLE=IDS[:BAGS]",
                   help="ids (and bags) per rank per step of a table (default 1)")
    p.add_argument("--lookup-rate", type=float, default=4e6, help="lookups of a 64-wide row per s")
    p.add_argument("--bandwidth", type=float, default=1e9, help="collective bytes per s per rank")
    p.add_argument("--half", action="store_true", help="16-bit floats on the wire")
    p.add_argument("--int64-ids", action="store_true", help="int64 ids on the wire")
    p.add_argument("--json", action="store_true", help="print the plan and report as JSON")
    p = _command(sub, "checkpoint-verify", "check a checkpoint's manifest and checksums",
                 "Reads every file of the checkpoint and compares it with its manifest.",
                 _checkpoint_verify)
    p.add_argument("dest", help="the checkpoint's directory")
    p = _command(sub, "verify", "check every page and every row checksum of a closed store",
                 "Walks every B-tree page of data.mdb (and of a crash-left log) from the file, then\n"
                 "reads every row back through its checksum. Writes nothing; the store must not be\n"
                 "open for writing (verify a checkpoint of a live store instead).", _verify)
    p.add_argument("path", help="the store's (or a checkpoint's) directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p = _command(sub, "upgrade", "convert a closed store of on-disk format 1 or 2 to format 3",
                 "Rewrites the store in place; the store must not be open elsewhere.", _upgrade)
    p.add_argument("path", help="the store's directory")
    p = _command(sub, "expire", "delete rows not updated for K clock steps, then compact",
                 "K counts steps of the store's clock (`TierStore.advance`), as `TableSpec(ttl=K)`\n"
                 "does. The store must not be open elsewhere.", _expire)
    p.add_argument("path", help="the store's directory")
    p.add_argument("--older-than", type=int, required=True, metavar="K",
                   help="delete rows last updated more than K clock steps ago")
    p.add_argument("--table", default=None, help="only this table (default: all)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p = _command(sub, "compact", "rewrite a closed store's file in key order (smaller)",
                 "Copies the rows into a new file in key order and swaps it in; the store must\n"
                 "not be open elsewhere.", _compact)
    p.add_argument("path", help="the store's directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
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
