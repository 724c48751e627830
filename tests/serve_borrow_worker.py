"""A process for the serving tests: an in-process reader while a write transaction is held.

python tests/serve_borrow_worker.py STORE

A thread holds a write transaction on the writer's environment (what the background writer does
while it commits) while another thread opens a ReadOnlyStore, reads, refreshes and reads again.
Prints `OK` when the reader finished without waiting for the transaction and read the flushed
rows. A reader that waits for the write lock (py-lmdb may keep the GIL while it waits) hangs
this process, which the test's timeout turns into a failure.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch

import tierstore as ts
from tests import as_format
from tierstore.serving import ReadOnlyStore


def main() -> None:
    path = Path(sys.argv[1])
    spec = ts.TableSpec("t", 400, 4, optimizer=ts.Adagrad(0.1))
    gen = torch.Generator().manual_seed(6)
    with ts.TierStore(path, [spec], device_capacity=16, host_capacity=32, device="cpu",
                      write_buffer=8, **as_format.options()) as store:
        for _ in range(3):
            store.apply("t", torch.randint(0, 400, (200,), generator=gen),
                        torch.randn(200, 4, generator=gen))
        store.flush()
        want = store.read("t", torch.arange(400))
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with store.backend.env.begin(write=True):
                held.set()
                release.wait(60)

        got: dict[str, object] = {}

        def serve() -> None:
            with ReadOnlyStore(path, device="cpu", timeout=1) as reader:
                got["first"] = reader.read("t", torch.arange(400))
                reader.refresh()
                got["again"] = reader.read("t", torch.arange(400))
                got["borrowed"] = reader.stats()["borrowed_env"]

        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        held.wait(10)
        reader_thread = threading.Thread(target=serve, daemon=True)
        reader_thread.start()
        reader_thread.join(10)
        waited = reader_thread.is_alive()
        release.set()
        holder.join()
        reader_thread.join()
    if waited:
        print("WAITED", flush=True)
        return
    same = torch.equal(got["first"], want) and torch.equal(got["again"], want)
    print("OK" if same and got["borrowed"] is True else f"WRONG {got.get('borrowed')}", flush=True)


if __name__ == "__main__":
    main()
