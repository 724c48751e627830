"""Mutation testing driver (a dev tool, not a CI step): mutmut's mutants, one forked pytest each.

    python -m tests.mutate tierstore/optimizers.py --tests "tests/test_reference_math.py" \\
        [--every K] [--no-jit] [--out FILE.json] [--retest EARLIER.json]

Each of mutmut's mutants of the file is written in place, a child forked from a process that has
already imported torch/numpy/numba runs `pytest -x` on the given tests, and the file is restored
(with its mtime, so numba's on-disk cache of the original stays valid). A failing or timed-out
run kills the mutant. `--every K` tests every K-th mutant (a deterministic sample) on big files;
`--no-jit` sets NUMBA_DISABLE_JIT=1 so numba kernels run as Python instead of recompiling per
mutant. This is `mutmut run` with the interpreter start-up paid once; see docs/testing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path


def _run_child(args: list[str], timeout: float) -> tuple[str, float]:
    """Fork, run pytest with `args` in the child; ('killed'|'survived'|'timeout', seconds)."""
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.setpgid(0, 0)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            import pytest

            rc = pytest.main(args)
        except BaseException:  # noqa: BLE001 - any failure to even run counts as killed
            rc = 99
        os._exit(int(rc))
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            return ("survived" if rc == 0 else "killed"), time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return "timeout", time.monotonic() - t0
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    """Run the mutants of one file against a test subset and write a JSON report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--tests", required=True, help="pytest arguments (quoted)")
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--no-jit", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--retest", default=None, help="a report of an earlier run: its survivors only")
    a = ap.parse_args(argv)
    if a.no_jit:
        os.environ["NUMBA_DISABLE_JIT"] = "1"
    os.environ.setdefault("HYPOTHESIS_PROFILE", "fast")
    import numba  # noqa: F401 - imported once, before forking
    import numpy  # noqa: F401
    import torch
    from mutmut import Context, list_mutations, mutate

    torch.set_num_threads(1)
    path = Path(a.path)
    src = path.read_text()
    stat = path.stat()
    ids = list_mutations(Context(source=src, filename=str(path)))
    chosen = ids[a.offset :: a.every]
    if a.retest:  # the survivors of an earlier run, by (line, index)
        again = {(r["line"] - 1, r["index"]) for r in json.loads(Path(a.retest).read_text())["survived"]}
        chosen = [m for m in ids if (m.line_number, m.index) in again]
    args = shlex.split(a.tests) + ["-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    status, base = _run_child(args, 3600)
    if status != "survived":
        print(f"baseline fails on {path}: {status}", file=sys.stderr)
        return 2
    timeout = 3 * base + 20
    print(f"{path}: {len(ids)} mutants, testing {len(chosen)}; baseline {base:.1f}s", flush=True)
    results = []
    lines = src.splitlines()
    try:
        for k, mid in enumerate(chosen):
            new, n = mutate(Context(source=src, mutation_id=mid, filename=str(path)))
            if n == 0 or new == src:
                continue
            path.write_text(new)
            try:
                status, secs = _run_child(args, timeout)
            finally:
                path.write_text(src)
                os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
            new_line = new.splitlines()[mid.line_number] if mid.line_number < len(new.splitlines()) else ""
            results.append({"line": mid.line_number + 1, "index": mid.index, "status": status,
                            "original": lines[mid.line_number].strip(), "mutant": new_line.strip(),
                            "seconds": round(secs, 1)})
            print(f"[{k + 1}/{len(chosen)}] line {mid.line_number + 1}: {status} ({secs:.1f}s)", flush=True)
    finally:
        path.write_text(src)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        killed = sum(r["status"] != "survived" for r in results)
        report = {"path": str(path), "tests": a.tests, "every": a.every, "offset": a.offset,
                  "retest": a.retest,
                  "no_jit": a.no_jit, "total_mutants": len(ids), "tested": len(results),
                  "killed": killed, "survived": [r for r in results if r["status"] == "survived"],
                  "results": results}
        if a.out:
            Path(a.out).write_text(json.dumps(report, indent=1))
        print(f"{path}: killed {killed}/{len(results)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
