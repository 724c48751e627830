"""`python -m bench.cli_startup`: how long the `tierstore` command takes to answer.

Each command runs in a fresh interpreter (`python -m tierstore.cli ...`, as the console script
does); the figure is the median wall time of `--runs` runs. `python -c "import torch"` is timed
beside them as the reference: what every call cost when the command imported torch to print help.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import machine, save, table

REPO = Path(__file__).resolve().parents[1]


def _make_store(path: Path) -> None:
    """A small store with two tables and a few stored rows (for `info`)."""
    code = ("import torch, tierstore as ts\n"
            f"s = ts.TierStore({str(path)!r}, [ts.TableSpec('a', 10**11, 16), ts.TableSpec('b', 1000, 8)],"
            " device='cpu')\n"
            "s.apply('a', torch.arange(100), torch.ones(100, 16)); s.close()\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def _time(argv: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    """Time the command's startup paths; print a table and write `cli_startup.json`."""
    ap = argparse.ArgumentParser(prog="python -m bench.cli_startup", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7, help="runs per command (default: 7)")
    ap.add_argument("--out", default=None, help="JSON directory (default: bench/out)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_cli_"))
    try:
        store = work / "s"
        _make_store(store)
        cli = [sys.executable, "-m", "tierstore.cli"]
        cases = {
            "tierstore --help": cli + ["--help"],
            "tierstore --version": cli + ["--version"],
            "tierstore export --help": cli + ["export", "--help"],
            "tierstore demo --help": cli + ["demo", "--help"],
            "tierstore info PATH": cli + ["info", str(store)],
            "tierstore bench-policies --help (imports torch)": cli + ["bench-policies", "--help"],
            "python -c 'import torch' (reference)": [sys.executable, "-c", "import torch"],
        }
        records = []
        for name, cmd in cases.items():
            times = _time(cmd, args.runs)
            records.append({"command": name, "median_s": statistics.median(times),
                            "min_s": min(times), "runs": args.runs})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(records, [("command", "command", ""), ("median_s", "median s", ".3f"),
                          ("min_s", "min s", ".3f")]))
    save("cli_startup", records, {"machine": machine()}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
