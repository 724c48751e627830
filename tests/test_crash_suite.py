"""The crash suite: SIGKILL during train, flush, checkpoint, overwrite, close, compaction, export
and import, checked against an independent model of the rows.

The model is a dict of numpy rows updated with the published optimizer math (SGD: w -= lr*g;
Adagrad: acc += g*g, w -= lr*g/(sqrt(acc)+eps)), not the library's code. After each kill:
- the live store reopens and every row is at its last acknowledged state or a later one;
- every acknowledged checkpoint verifies, and the newest restores to the model at its step
  (bit for bit for the SGD table, whose updates are exact in float32);
- every acknowledged export imports to the model at its step; every store an import created
  (acknowledged or not) is complete;
- the next checkpoint/export leaves no staging directory behind.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import tierstore as ts
from tests import crash_suite_worker as w
from tierstore import persistence
from tierstore.export import export_store, import_store

REPO = Path(__file__).resolve().parents[1]
RTOL = 2e-5  # Adagrad rows: the library's fused kernel may round a division differently


class Model:
    """Rows of both tables after every step, from numpy and the optimizers' published math."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.step = 0
        self.w = {"s": {}, "a": {}}
        self.acc: dict[int, np.ndarray] = {}
        self.hist: dict[tuple[str, int], list[tuple[int, np.ndarray]]] = {}

    def _row(self, table: str, i: int) -> np.ndarray:
        init = w.S_INIT if table == "s" else w.A_INIT
        return self.w[table].setdefault(i, np.full(4, init, np.float32))

    def advance(self, step: int) -> None:
        """Apply steps up to `step`."""
        while self.step < step:
            self.step += 1
            for table, (ids, g) in w.batch(self.step, self.phase).items():
                uniq, inv = np.unique(ids, return_inverse=True)
                gs = np.zeros((len(uniq), 4), np.float32)
                np.add.at(gs, inv, g)  # summed in input order, like the store
                for k, i in enumerate(uniq.tolist()):
                    row = self._row(table, i)
                    if table == "s":
                        row -= np.float32(w.S_LR) * gs[k]
                    else:
                        acc = self.acc.setdefault(i, np.zeros(4, np.float32))
                        acc += gs[k] * gs[k]
                        row -= np.float32(w.A_LR) * gs[k] / (np.sqrt(acc) + np.float32(w.A_EPS))
                    self.hist.setdefault((table, i), [(0, self._init(table))]).append(
                        (self.step, row.copy()))

    @staticmethod
    def _init(table: str) -> np.ndarray:
        return np.full(4, w.S_INIT if table == "s" else w.A_INIT, np.float32)

    def ids(self, table: str) -> np.ndarray:
        return np.array(sorted(i for t, i in self.hist if t == table), dtype=np.int64)

    def at(self, table: str, step: int) -> np.ndarray:
        """Rows of every touched id of `table` after `step` (in `ids` order)."""
        out = []
        for i in self.ids(table).tolist():
            h = self.hist[(table, i)]
            out.append([v for s, v in h if s <= step][-1])
        return np.array(out, np.float32).reshape(-1, 4)

    def allowed(self, table: str, i: int, acked: int, upto: int) -> list[np.ndarray]:
        """States of row i at or after its last change up to `acked`, up to step `upto`."""
        h = [(s, v) for s, v in self.hist[(table, i)] if s <= upto]
        k = max(j for j, (s, _) in enumerate(h) if s <= acked)
        return [v for _, v in h[k:]]


def _match(table: str, got: np.ndarray, want: np.ndarray) -> bool:
    if table == "s":
        return np.array_equal(got, want)
    return np.allclose(got, want, rtol=RTOL, atol=1e-7)


class Zygote:
    """The forking worker process (see crash_suite_worker.py)."""

    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "TIERSTORE_COMPACT_ON_CLOSE": "1.0"}
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "crash_suite_worker.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, cwd=REPO)

    def run(self, phase: str, root: Path) -> int:
        self.proc.stdin.write(f"RUN {phase} {root}\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def reap(self, pid: int) -> None:
        self.proc.stdin.write(f"REAP {pid}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "reaped"

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def _acks(root: Path) -> list[list[str]]:
    path = root / "acks"
    lines = path.read_text().splitlines() if path.exists() else []
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    assert not errors, errors
    return [ln.split() for ln in lines]


def crash_trial(zygote: Zygote, root: Path, phase: str, rng: random.Random) -> dict:
    """Run `phase`, SIGKILL it at a random point, then check everything against the model."""
    root.mkdir(parents=True)
    pid = zygote.run(phase, root)
    want = rng.randint(1, 5)
    t0 = time.monotonic()
    try:
        # kill shortly after the start of the phase's want-th operation: most kills land inside
        # it (a flush, a copy, a rename, a compaction), the rest in the training around it
        while time.monotonic() - t0 < 120:
            if sum(a[0] == "B" for a in _acks(root)) >= want:
                break
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.08))
    finally:
        os.kill(pid, signal.SIGKILL)
        zygote.reap(pid)
    acks = _acks(root)
    in_op = acks[-1][0] == "B"  # killed inside the operation
    started = max(int(a[1]) for a in acks if a[0] == "T")
    model = Model(phase)
    model.advance(started)
    durable = max((int(a[1]) for a in acks if a[0] in "FXCE"), default=0)

    # the live store: every touched row at its last acknowledged state or later
    store = w.open_store(root / "store", phase)
    checked = 0
    for table in ("s", "a"):
        ids = model.ids(table)
        got = store.read(table, torch.from_numpy(ids)).numpy()
        for k, i in enumerate(ids.tolist()):
            ok = any(_match(table, got[k], v) for v in model.allowed(table, i, durable, started))
            assert ok, f"{phase}: row {table}[{i}] is not at step {durable} or later: {got[k]}"
        checked += len(ids)
    lost = 0  # (every failure above is a lost row; reaching here means none)

    # checkpoints: every acknowledged one verifies; the newest restores to the model exactly
    ckpts = {a[2]: int(a[1]) for a in acks if a[0] == "C"}
    restored = None
    for name, step in ckpts.items():
        manifest = persistence.verify_checkpoint(root / name)
        assert manifest["step"] >= step  # an overwritten dest may already hold a later one
    for path in root.glob("ck*"):  # published (acknowledged or not): always complete
        persistence.verify_checkpoint(path)
    if ckpts:
        name = max(ckpts, key=lambda n: ckpts[n])
        restored = json.loads((root / name / "MANIFEST.json").read_text())["step"]
        back = ts.TierStore.restore(root / name, root / "restored", device_capacity=0,
                                    host_capacity=0, device="cpu")
        for table in ("s", "a"):
            got = back.read(table, torch.from_numpy(model.ids(table))).numpy()
            want = model.at(table, restored)
            if table == "s":
                assert np.array_equal(got, want), f"{phase}: checkpoint {name} differs"
            else:
                assert np.allclose(got, want, rtol=RTOL, atol=1e-7)
        back.close()

    # exports and imports
    exports = [int(a[1]) for a in acks if a[0] == "E"]
    if exports:
        import_store(root / "exp", root / "check-import")
        back = w.open_store(root / "check-import", phase)
        ex = json.loads((root / "exp" / "manifest.json").read_text())
        got = back.read("s", torch.from_numpy(model.ids("s"))).numpy()
        assert any(np.array_equal(got, model.at("s", s)) for s in range(max(exports), started + 1)), \
            f"{phase}: the export is not at an acknowledged step or later"
        back.close()
        assert ex["tables"]
    for imp in sorted(root.glob("imp-*")):  # acknowledged or not: a store there is complete
        back = w.open_store(imp, phase)
        assert np.array_equal(back.read("s", torch.from_numpy(model.ids("s"))).numpy(),
                              model.at("s", 3)), f"{phase}: {imp.name} is incomplete"
        back.close()

    # the next checkpoint and export clean up what the kill left
    store.checkpoint(root / "after", step=started)
    export_store(store, root / "after-exp")
    store.close()
    leftovers = [p.name for p in root.iterdir() if ".partial-" in p.name or ".old-" in p.name]
    assert not leftovers, f"{phase}: staging left after the next checkpoint: {leftovers}"
    return {"phase": phase, "in_op": in_op, "acks": len(acks), "durable": durable,
            "started": started,
            "rows_checked": checked, "restored": restored, "lost": lost}


FAST = [("train", 0), ("overwrite", 1), ("export", 2)]


@pytest.mark.parametrize("phase,seed", FAST)
def test_crash_fast(zygote, tmp_path, phase, seed):
    crash_trial(zygote, tmp_path / "t", phase, random.Random(seed))


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(40))
def test_crash_suite(zygote, tmp_path, trial):
    phase = w.PHASES[trial % len(w.PHASES)]
    res = crash_trial(zygote, tmp_path / "t", phase, random.Random(1000 + trial))
    print(json.dumps(res))
