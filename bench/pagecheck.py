"""Cost of the structural page checks (issue 38) on LMDB row reads, against a baseline source tree.

Each measurement runs in a fresh process that imports `tierstore` from the given source tree
(this one, or `--baseline SRC`, e.g. an extracted older commit), fills a 2M-row table once
(dim 64, page-cached) and times `LmdbBackend.get` of 4096 random ids (half stored, half misses)
through the page walker (the default) and through py-lmdb (`TIERSTORE_PAGE_READS=0`, as with a
trimmed map; the read-only handle reads the same way). Rounds alternate the two trees.

    git archive 3e9f718 tierstore | tar -x -C /tmp/base
    python -m bench.pagecheck --baseline /tmp/base --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import OUT_DIR, machine, save, table

_PROBE = r"""
import json, os, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from tierstore.backends.lmdb_backend import LmdbBackend
path, reps = sys.argv[2], int(sys.argv[3])
W = 65
be = LmdbBackend(path)
if be.get_meta("filled") is None:
    rows = np.arange(2_000_000, dtype=np.int64)
    for lo in range(0, len(rows), 200_000):
        r = rows[lo:lo + 200_000]
        be.put({"t": (r, np.ones((len(r), W), np.float32))})
    be.put_meta({"filled": {"v": 1}})
    be.sync()
rng = np.random.default_rng(0)
ts = []
for _ in range(reps):
    ids = rng.integers(0, 4_000_000, 4096)
    t = time.perf_counter()
    be.get("t", ids, W)
    ts.append(time.perf_counter() - t)
be.close()
print(json.dumps({"first_ms": ts[1] * 1e3, "median_ms": float(np.median(ts[5:])) * 1e3}))
"""


def _run(src: str, path: str, mode: str, reps: int) -> dict:
    env = dict(os.environ)
    if mode == "py-lmdb":
        env["TIERSTORE_PAGE_READS"] = "0"
    p = subprocess.run([sys.executable, "-c", _PROBE, src, path, str(reps)], env=env,
                       capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Print the read cost with and without the checks; write JSON under bench/out/."""
    p = argparse.ArgumentParser(prog="python -m bench.pagecheck", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="a source tree without the checks")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=60, help="timed gets per process")
    p.add_argument("--out", default=str(OUT_DIR))
    args = p.parse_args(argv)
    here = str(Path(__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory() as tmp:
        for src in (args.baseline, here):  # a filled store per tree (the file format is shared)
            _run(src, f"{tmp}/{Path(src).name}", "walker", 6)
        res: dict[tuple[str, str], list[dict]] = {}
        for _ in range(args.rounds):
            for mode in ("walker", "py-lmdb"):
                for name, src in (("baseline", args.baseline), ("checked", here)):
                    res.setdefault((mode, name), []).append(
                        _run(src, f"{tmp}/{Path(src).name}", mode, args.reps))
    records = []
    for mode in ("walker", "py-lmdb"):
        base = statistics.median(r["median_ms"] for r in res[(mode, "baseline")])
        mine = statistics.median(r["median_ms"] for r in res[(mode, "checked")])
        records.append({"path": mode, "baseline_ms": base, "checked_ms": mine,
                        "cost": mine / base - 1})
    print(table(records, [("path", "read path", "s"), ("baseline_ms", "baseline ms/4096", ".2f"),
                          ("checked_ms", "checked ms/4096", ".2f"), ("cost", "cost", "+.0%")]))
    save("pagecheck", records, {"machine": machine(), "rounds": args.rounds}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
