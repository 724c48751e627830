"""Issue 38's damage suite: byte flips, zeroed pages and truncations of a closed store's files
(`data.mdb` and the crash-left write-behind log `wlog/data.mdb`), opened read-only and for
writing in fresh processes (tests/damage_worker.py). Counted outcome: no crash (a signal or a
non-tierstore exception) and no silently wrong row: every open either raises a TierstoreError or
reads every row at its acknowledged state or later. A fast subset runs by default; the sweep
over every page of both files runs under `-m slow`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tierstore as ts
from tierstore.backends.pagecheck import P_BRANCH, P_LEAF, P_META, P_OVERFLOW, check_file

WORKER = Path(__file__).with_name("damage_worker.py")
ROOT = Path(__file__).resolve().parents[1]
KINDS = {P_META: "meta", P_BRANCH: "branch", P_LEAF: "leaf", P_OVERFLOW: "overflow", 0: "free"}


def _env() -> dict:
    return dict(os.environ)


def build_store(path: Path, rows: int = 3000) -> Path:
    """A closed store of `rows` trained rows; returns the .npz of its expected rows."""
    spec = ts.TableSpec("t", 10**6, 8, optimizer=ts.Adagrad(0.1))
    ids = torch.arange(rows) * 31
    with ts.TierStore(path, spec, device_capacity=64, host_capacity=64, seed=3, device="cpu") as s:
        g = torch.Generator().manual_seed(0)
        s.apply("t", ids, torch.randn(rows, 8, generator=g))
        want = s.read("t", ids).numpy()
    np.savez(path.parent / "want.npz", ids=ids.numpy(), rows=want)
    return path.parent / "want.npz"


def build_crashed(path: Path) -> Path:
    """A store whose writer was SIGKILLed with every row's newer version in its log."""
    npz = path.parent / "want.npz"
    p = subprocess.run([sys.executable, str(WORKER), "build", str(path), str(npz)], env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == -9, p.stderr[-2000:]
    assert (path / "wlog" / "data.mdb").exists()
    return npz


def probe_many(cases: list[tuple[Path, str, Path]]) -> list[dict]:
    """Each case's outcome from fresh worker processes (a crash costs its process only)."""
    spec = cases[0][0].parent.parent / "cases.json"
    spec.write_text(json.dumps([[str(a), m, str(w)] for a, m, w in cases]))
    out: list[dict] = []
    while len(out) < len(cases):
        p = subprocess.run([sys.executable, str(WORKER), "many", str(spec), str(len(out))],
                           env=_env(), capture_output=True, text=True, timeout=1200)
        got = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith('{"case"')]
        out += got
        if len(out) < len(cases) and p.returncode == 0:
            raise AssertionError(p.stderr[-2000:])
        if len(out) < len(cases):  # the next case crashed its process
            out.append({"case": len(out), "outcome": "crash", "rc": p.returncode,
                        "stderr": p.stderr[-600:]})
    return out


def tally(cases: list[tuple[Path, str, Path]], outs: list[dict], what: list[str]) -> dict:
    """{"crash": n, "wrong": n, "error": n, "read": n} and the failing cases described."""
    count = {"crash": 0, "wrong": 0, "error": 0, "read": 0}
    bad = []
    for (_, mode, _), o, w in zip(cases, outs, what):
        if o["outcome"] == "crash":
            count["crash"] += 1
            bad.append((w, mode, o))
        elif o["outcome"] == "read" and o["wrong"]:
            count["wrong"] += 1
            bad.append((w, mode, o))
        else:
            count[o["outcome"]] += 1
    return {**count, "bad": bad}


def damaged_copy(src: Path, dst: Path, file: str, at: int, data: bytes | None = None,
                 size: int | None = None) -> Path:
    """A copy of store `src` with `data` written at byte `at` of `file`, or truncated to `size`."""
    shutil.copytree(src, dst)
    target = dst / file
    if size is not None:
        os.truncate(target, size)
    else:
        with open(target, "r+b") as f:
            f.seek(at)
            f.write(data)
    return dst


def damages(data: Path, per_kind: int, rng: np.random.Generator) -> list[tuple[str, int, bytes]]:
    """(description, offset, bytes) cases over every page kind of an LMDB file: zeroed pages and
    byte flips in headers (page number, flags, mp_lower, mp_upper), node pointers and nodes."""
    raw = data.read_bytes()
    kinds = check_file(data, "probe")["kinds"]
    out = []
    for kind, name in KINDS.items():
        pages = np.flatnonzero(kinds == kind)
        if kind == 0:
            pages = pages[pages >= 2]
        for pg in rng.permutation(pages)[:per_kind].tolist():
            b = pg * 4096
            out.append((f"{name} page {pg} zeroed", b, bytes(4096)))
            spots = [0, 10, 12, 14, 16, 17, int(rng.integers(18, 4096))]
            if kind == P_META:
                spots = [16, 24 + int(rng.integers(0, 120)), 136, 144]
            for off in spots:
                out.append((f"{name} page {pg} byte {off} flipped", b + off,
                            bytes([raw[b + off] ^ int(rng.integers(1, 256))])))
    return out


# row 4: a truncated data.mdb -----------------------------------------------------------------------
def test_truncated_data_file_is_an_error_not_sigbus(tmp_path):
    want = build_store(tmp_path / "base" / "s")
    size = (tmp_path / "base" / "s" / "data.mdb").stat().st_size
    cases, what = [], []
    for i, frac in enumerate((0.25, 0.5, 0.75)):
        d = damaged_copy(tmp_path / "base" / "s", tmp_path / f"c{i}", "data.mdb", 0,
                         size=int(size * frac) // 4096 * 4096)
        cases += [(d, "ro", want), (d, "rw", want)]
        what += [f"truncated to {frac}"] * 2
    outs = probe_many(cases)
    assert all(o["outcome"] == "error" and o["type"] == "StoreCorruptError" for o in outs), outs


# rows 5 and 12: a damaged or truncated write-behind log ---------------------------------------------
def test_damaged_log_is_refused_and_last_flush_opens(tmp_path):
    want = build_crashed(tmp_path / "base" / "s")
    log = tmp_path / "base" / "s" / "wlog" / "data.mdb"
    kinds = check_file(log, "probe")["kinds"]
    leaf = int(np.flatnonzero(kinds == P_LEAF)[-1])
    overs = np.flatnonzero(kinds == P_OVERFLOW)
    over = int(overs[len(overs) // 2])
    size = log.stat().st_size
    plan = [("log truncated to 0", None, 0), ("log truncated to half", None, size // 2 // 4096 * 4096),
            (f"log leaf {leaf} zeroed", leaf * 4096, bytes(4096)),
            (f"log overflow {over} zeroed", over * 4096, bytes(4096)),
            (f"log leaf {leaf} mp_lower flipped", leaf * 4096 + 12, b"\x7f")]
    cases, what = [], []
    for i, (w, at, arg) in enumerate(plan):
        d = damaged_copy(tmp_path / "base" / "s", tmp_path / f"c{i}", "wlog/data.mdb", at or 0,
                         data=arg if at is not None else None, size=arg if at is None else None)
        cases += [(d, "rw", want)]
        what += [w]
    outs = probe_many(cases)
    for w, o in zip(what, outs):
        assert o["outcome"] == "error" and o["type"] == "LogCorruptError", (w, o)
        assert "last_flush" in o["msg"] and "at stake" in o["msg"], o
    # the explicit choice: the same damaged copies open without the log's rows
    outs = probe_many([(d, "last", want) for d, _, _ in cases])
    for w, o in zip(what, outs):
        assert o == {"case": o["case"], "outcome": "read", "wrong": 0}, (w, o)
    clean = probe_many([(tmp_path / "base" / "s", "rw", want)])[0]
    assert clean["outcome"] == "read" and clean["wrong"] == 0  # the undamaged log replays


# the sweep ---------------------------------------------------------------------------------------
def _sweep(tmp_path: Path, file: str, per_kind: int, modes: tuple[str, ...], seed: int) -> dict:
    base = tmp_path / "base" / "s"
    want = build_crashed(base) if file.startswith("wlog") else build_store(base)
    rng = np.random.default_rng(seed)
    cases, what = [], []
    for i, (w, at, data) in enumerate(damages(base / file, per_kind, rng)):
        d = damaged_copy(base, tmp_path / f"c{i}", file, at, data)
        for mode in modes:
            cases.append((d, mode, want))
            what.append(w)
    size = (base / file).stat().st_size
    for j, frac in enumerate((0.0, 0.3, 0.6, 0.9)):
        d = damaged_copy(base, tmp_path / f"t{j}", file, 0, size=int(size * frac) // 4096 * 4096)
        for mode in modes:
            cases.append((d, mode, want))
            what.append(f"truncated to {frac}")
    return tally(cases, probe_many(cases), what)


@pytest.mark.parametrize("file", ["data.mdb", "wlog/data.mdb"])
def test_damage_sweep_fast(tmp_path, file):
    got = _sweep(tmp_path, file, 1, ("rw",) if file.startswith("wlog") else ("ro", "rw"), 1)
    assert got["crash"] == 0 and got["wrong"] == 0, got["bad"]
    assert got["error"] >= 1


@pytest.mark.slow
@pytest.mark.ci  # about 70 s for both files
@pytest.mark.parametrize("file", ["data.mdb", "wlog/data.mdb"])
def test_damage_sweep(tmp_path, file):
    modes = ("rw", "last") if file.startswith("wlog") else ("ro", "rw")
    got = _sweep(tmp_path, file, 4, modes, 2)
    print(f"damage sweep of {file}: {got['crash']} crashes, {got['wrong']} silently wrong, "
          f"{got['error']} errors, {got['read']} exact reads")
    assert got["crash"] == 0 and got["wrong"] == 0, got["bad"]
