"""Deterministic training used by the crash tests; run as a script it trains until killed.

python tests/crash_worker.py STORE CKPT_ROOT STEPS FLUSH_EVERY CKPT_EVERY DEVICE_CAP HOST_CAP

Prints `F <step>` after each flush() returns and `C <step>` after each checkpoint() returns.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

import tierstore as ts
from tests import as_format
from tierstore.backends.lmdb_backend import LmdbBackend

SPECS = [ts.TableSpec("a", 10**11, 8, optimizer=ts.Adagrad(0.1)),
         ts.TableSpec("b", 5000, 4, optimizer=ts.Adam(0.01), init=ts.NormalInit(0.5))]
SEED = 7
A_STRIDE = 49_999_999  # spreads table a's 2000 hot ids over its 10**11 rows
BATCH = 384


def open_store(path: str | Path, device_cap: int, host_cap: int, **kw) -> ts.TierStore:
    """The store the crash tests train (its tables as TIERSTORE_TEST_TABLE_FORMAT asks)."""
    kw = {**as_format.options(), **kw}
    return ts.TierStore(path, SPECS, device_capacity=device_cap, host_capacity=host_cap,
                        seed=SEED, device="cpu", **kw)


def batch(step: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Ids and gradients of one step, a pure function of the step."""
    g = torch.Generator().manual_seed(1000 + step)
    a = torch.randint(0, 2000, (BATCH,), generator=g) * A_STRIDE
    b = (torch.rand(BATCH, generator=g) ** 3 * 5000).long()
    return {"a": (a, torch.randn(BATCH, 8, generator=g)),
            "b": (b, torch.randn(BATCH, 4, generator=g))}


def train_step(store: ts.TierStore, step: int) -> None:
    """Apply one step's batch to both tables."""
    for name, (ids, grads) in batch(step).items():
        store.apply(name, ids, grads)


def dump_backend(backend: LmdbBackend) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every stored row of every table, from one snapshot: {table: (ids, payloads)}."""
    txn = backend.snapshot()
    try:
        out = {}
        for spec in SPECS:
            parts = list(backend.iter_rows(spec.name, spec.row_dim, txn))
            ids = np.concatenate([p[0] for p in parts]) if parts else np.empty(0, np.int64)
            pay = (np.concatenate([p[1] for p in parts]) if parts
                   else np.empty((0, spec.row_dim), np.float32))
            out[spec.name] = (ids, pay)
        return out
    finally:
        txn.abort()


def dump_path(path: str | Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """`dump_backend` of a store or checkpoint directory opened read-only."""
    backend = LmdbBackend(path, readonly=True)
    try:
        return dump_backend(backend)
    finally:
        backend.close()


def same(x: dict, y: dict) -> bool:
    """Bit-exact equality of two dumps."""
    return x.keys() == y.keys() and all(
        torch.equal(torch.from_numpy(x[k][0]), torch.from_numpy(y[k][0]))
        and torch.equal(torch.from_numpy(x[k][1]), torch.from_numpy(y[k][1])) for k in x)


def run(path: str, ckpt_root: str, steps: int, flush_every: int, ckpt_every: int,
        device_cap: int, host_cap: int, out=None) -> None:
    """Train `steps` steps, flushing and checkpointing periodically; report acks to `out`."""
    store = open_store(path, device_cap, host_cap)
    if out is not None:
        print("ready", file=out, flush=True)
    for step in range(1, steps + 1):
        train_step(store, step)
        if ckpt_every and step % ckpt_every == 0:
            store.checkpoint(Path(ckpt_root) / f"step-{step:06d}", step=step)
            if out is not None:
                print(f"C {step}", file=out, flush=True)
        elif flush_every and step % flush_every == 0:
            store.flush()
            if out is not None:
                print(f"F {step}", file=out, flush=True)
    store.close()
    if out is not None:
        print("done", file=out, flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    a = sys.argv[1:]
    run(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), int(a[5]), int(a[6]), out=sys.stdout)
