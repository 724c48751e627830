"""kill -9 a training process at random moments: nothing acknowledged is lost, nothing is torn."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests import crash_worker as w
from tests.reference import DictStore
from tierstore import TierStore, persistence

REPO = Path(__file__).resolve().parents[1]
FLUSH_EVERY, CKPT_EVERY = 2, 5
SMALL, BIG = (64, 256), (8192, 8192)  # BIG holds every hot row: LMDB changes only at flushes


def digest(dump: dict) -> str:
    """A fingerprint of a dump's exact bytes."""
    h = hashlib.sha256()
    for name in sorted(dump):
        ids, pay = dump[name]
        h.update(name.encode() + ids.tobytes() + pay.tobytes())
    return h.hexdigest()


class Reference:
    """The uninterrupted run, advanced on demand: stored rows at every flush point."""

    def __init__(self, path: Path) -> None:
        self.store = w.open_store(path, *SMALL)
        self.step = 0
        self.digests = {0: digest(w.dump_backend(self.store.backend))}
        self.dumps: dict[int, dict] = {}

    def at(self, step: int) -> str:
        """Digest of the stored rows after flush point `step`."""
        while self.step < step:
            self.step += 1
            w.train_step(self.store, self.step)
            if self.step % FLUSH_EVERY == 0 or self.step % CKPT_EVERY == 0:
                self.store.flush()
                dump = w.dump_backend(self.store.backend)
                self.digests[self.step] = digest(dump)
                if self.step % CKPT_EVERY == 0:
                    self.dumps[self.step] = dump
        return self.digests[step]

    def dump(self, step: int) -> dict:
        """Stored rows after checkpoint step `step`."""
        self.at(step)
        return self.dumps[step]


class PayloadModel:
    """The same run on the dict model (no tiers, no LMDB): every row's payload after each step
    that touched it. Its updates are checked against the optimizers' definitions as it goes."""

    def __init__(self) -> None:
        self.dict = DictStore(w.SPECS, w.SEED)
        self.step = 0
        self.history: dict[tuple[str, int], list[tuple[int, np.ndarray]]] = {}

    def advance(self, step: int) -> None:
        """Replay the worker's steps up to `step`."""
        while self.step < step:
            self.step += 1
            for name, (ids, grads) in w.batch(self.step).items():
                for row in self.dict.apply(name, ids, grads):
                    payload = self.dict.rows[(name, row)].numpy().copy()
                    self.history.setdefault((name, row), []).append((self.step, payload))

    def allowed(self, table: str, row: int, lo: int, hi: int) -> list[np.ndarray]:
        """The row's payload as of step `lo`, and every payload it took in steps (lo, hi]."""
        hist = self.history.get((table, row), [])
        out = [p for s, p in hist if lo < s <= hi]
        before = [p for s, p in hist if s <= lo]
        return out + before[-1:]

    def check_live(self, now: dict, acked: int, hi: int) -> int:
        """Every row written by step `acked` is stored, and every stored row holds a payload the
        model had at some step in [acked, hi]; returns the number of rows checked."""
        self.advance(hi)
        checked = 0
        for spec in w.SPECS:
            ids, pay = now[spec.name]
            stored = dict(zip(ids.tolist(), pay))
            must = {row for (t, row), h in self.history.items() if t == spec.name and h[0][0] <= acked}
            missing = must - stored.keys()
            assert not missing, f"{len(missing)} acknowledged rows of {spec.name} lost, e.g. {min(missing)}"
            for row, p in stored.items():
                ok = self.allowed(spec.name, row, acked, hi)
                # the stored row is the payload and its last-update stamp (the worker's clock stays 0)
                assert int(p[spec.stamp_col:].view(np.int32)[0]) == 0
                body = p[: spec.payload_dim]
                assert any(np.array_equal(body.view(np.uint32), q.view(np.uint32)) for q in ok), \
                    f"{spec.name} row {row} holds no payload of steps {acked}..{hi}"
                checked += 1
        return checked


@pytest.fixture(scope="module")
def model():
    return PayloadModel()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = Reference(tmp_path_factory.mktemp("reference") / "store")
    yield ref
    ref.store.close()


def next_flush_point(step: int) -> int:
    """The first flush point after `step`."""
    s = step + 1
    while s % FLUSH_EVERY and s % CKPT_EVERY:
        s += 1
    return s


def run_trial(tmp: Path, ref: Reference, model: PayloadModel, rng: random.Random,
              caps: tuple[int, int], kill_after_acks: int | None = None) -> dict:
    """Start the worker, SIGKILL it, then check the live store and the last checkpoint."""
    store, ckroot = tmp / "store", tmp / "ckpts"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "crash_worker.py"), str(store), str(ckroot),
         "1000000", str(FLUSH_EVERY), str(CKPT_EVERY), str(caps[0]), str(caps[1])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    seen = []
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        # counting acks (not seconds) keeps the kill points spread over the run on a busy machine
        acks = kill_after_acks if kill_after_acks is not None else rng.randint(0, 20)
        seen = [proc.stdout.readline() for _ in range(acks)]
        if kill_after_acks is None:
            time.sleep(rng.uniform(0.0, 0.3))  # anywhere in the next steps, flushes, copies
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    out = [ln.strip() for ln in seen] + proc.stdout.read().split("\n")
    acks = [(kind, int(s)) for kind, _, s in (ln.partition(" ") for ln in out)
            if kind in ("F", "C")]
    acked = max((s for _, s in acks), default=0)
    acked_ckpt = max((s for k, s in acks if k == "C"), default=0)

    # the live store reopens, every row is whole, and acknowledged rows are there
    live = w.open_store(store, *caps)
    now = w.dump_backend(live.backend)  # raises on a torn (wrong-size) row
    live.close()
    # every acknowledged flush's rows are there with the payloads of the independent model
    checked = model.check_live(now, acked, next_flush_point(acked))
    if caps == BIG:
        allowed = {ref.at(acked), ref.at(next_flush_point(acked))}
        assert digest(now) in allowed, f"live store is not at flush point {acked} or the next"

    # the last complete checkpoint is at least the last acknowledged one and restores exactly
    done = sorted(p for p in ckroot.glob("step-*") if (p / persistence.MANIFEST).exists())
    if acked_ckpt:
        assert done and done[-1].name >= f"step-{acked_ckpt:06d}"
    restored = None
    if done:
        for p in done:
            persistence.verify_checkpoint(p)
        last = done[-1]
        step = persistence.read_manifest(last)["step"]
        back = TierStore.restore(last, tmp / "restored", device_capacity=32, host_capacity=32,
                                   device="cpu")
        got = w.dump_backend(back.backend)
        back.close()
        assert w.same(got, ref.dump(step)), f"checkpoint of step {step} differs from reference"
        restored = step
    return {"acked": acked, "acked_ckpt": acked_ckpt, "restored": restored,
            "checkpoints": len(done), "rows_checked": checked}


@pytest.mark.parametrize("trial,caps,after", [(0, SMALL, None), (1, BIG, None), (2, BIG, 7)])
def test_kill9_during_training(tmp_path, reference, model, trial, caps, after):
    res = run_trial(tmp_path, reference, model, random.Random(trial), caps, kill_after_acks=after)
    if after:
        assert res["acked"] >= after and res["rows_checked"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("trial", [pytest.param(t, marks=pytest.mark.ci) for t in range(6)]
                         + list(range(6, 24)))
def test_kill9_many(tmp_path, reference, model, trial):
    rng = random.Random(100 + trial)
    caps = SMALL if trial % 2 else BIG
    after = rng.randint(1, 30) if trial % 3 == 0 else None
    res = run_trial(tmp_path, reference, model, rng, caps, kill_after_acks=after)
    print(f"trial {trial} caps {caps}: {res}")
