"""A writer process for the serving tests: trains with flushes while readers read the store.

python tests/serve_worker.py STORE STATES STEPS FLUSH_EVERY [COMPACT_AT]

After each flush it saves every row's weights as STATES/<k>.npy (k = flushes so far) and prints
`F <k>`; the LMDB map starts at 1 MiB so it grows during the run; at flush COMPACT_AT it
compacts the live store (a new data file). The write-behind ring holds 16 rows (a log of 64), so
between flushes evicted rows go through the ring and the log, and the background writer merges
the log into the tables. Ends with `MERGED <n>` (intervals between flushes in which the
background writer merged the log) and `DONE` after close().
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

import tierstore as ts
from tests import as_format
from tierstore.backends import lmdb_backend

ROWS, DIM = 3000, 8
SPEC = ts.TableSpec("t", ROWS, DIM, optimizer=ts.Adagrad(0.1))


def main() -> None:
    store_path, states = Path(sys.argv[1]), Path(sys.argv[2])
    steps, flush_every = int(sys.argv[3]), int(sys.argv[4])
    compact_at = int(sys.argv[5]) if len(sys.argv) > 5 else -1
    lmdb_backend._INITIAL_MAP = 1 << 20  # grow the map while readers read
    # readers see commits without fsync (a shared page cache); skip it to keep the test fast
    lmdb_backend.LmdbBackend.sync = lambda self: None
    states.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(5)
    # caches far below the touched rows: dirty rows are evicted to LMDB between flushes
    store = ts.TierStore(store_path, [SPEC], device_capacity=64, host_capacity=128, seed=1,
                         device="cpu", write_buffer=16,
                         **as_format.options())
    flushes = busy = 0
    merged = store.stats()["writeback"]["log_merged"]
    for step in range(1, steps + 1):
        ids = torch.randint(0, ROWS, (512,), generator=gen)
        store.apply("t", ids, torch.randn(512, DIM, generator=gen))
        if step % flush_every == 0:
            store.writeback.drain()  # let the background writer finish its appends and merges
            now = store.stats()["writeback"]["log_merged"]
            busy += now > merged
            store.flush()
            merged = store.stats()["writeback"]["log_merged"]
            flushes += 1
            np.save(states / f"{flushes}.npy", store.read("t", torch.arange(ROWS)).numpy())
            if flushes == compact_at:
                store.backend.compact()
            print(f"F {flushes}", flush=True)
    store.close()
    print(f"MERGED {busy}", flush=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
