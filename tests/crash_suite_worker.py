"""Workloads for the crash suite, run in processes that the test SIGKILLs.

Run as a script it is a "zygote": it imports tierstore once, then for each line `RUN PHASE ROOT`
on stdin forks a child that runs that phase's loop until killed (printing its pid), and for
`REAP PID` waits for a killed child. Forking from a warm interpreter makes a trial cost a
fraction of a second instead of an interpreter start. Children write their acknowledgements,
one line each, to ROOT/acks (flushed per line, so a line is there once the call returned):

    T <step>            training step <step> is about to start
    B <step>            the phase's operation (flush, checkpoint, close, ...) is about to start
    F <step>            flush() returned after step <step>
    X <step>            close() returned after step <step> (then the store is reopened)
    C <step> <name>     checkpoint(ROOT/<name>) returned after step <step>
    E <step>            export_store(store, ROOT/exp, overwrite=True) returned after step <step>
    I <step> <name>     import_store(ROOT/exp, ROOT/<name>) returned; the export is of <step>

Only the public API is used: TierStore, apply, flush, close, checkpoint, export/import.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch

import tierstore as ts
from tests import as_format
from tierstore.export import export_store, import_store

SEED = 11
BATCH = 192
S_LR, A_LR, A_EPS = 0.5, 0.1, 1e-10
S_INIT, A_INIT = 0.25, 0.5
SPECS = [ts.TableSpec("s", 10**11, 4, optimizer=ts.SGD(S_LR), init=ts.ConstantInit(S_INIT)),
         ts.TableSpec("a", 5000, 4, optimizer=ts.Adagrad(A_LR, eps=A_EPS),
                      init=ts.ConstantInit(A_INIT))]
S_STRIDE = 333_331
PHASES = ("train", "flush", "checkpoint", "overwrite", "close", "compaction", "export", "import")
# (device rows, host rows, distinct hot ids of table s) per phase
CAPS = {"flush": (40_000, 0, 30_000), "compaction": (64, 128, 20_000)}
DEFAULT_CAPS = (64, 256, 3000)


def caps(phase: str) -> tuple[int, int, int]:
    """Cache sizes and hot-set size of a phase."""
    return CAPS.get(phase, DEFAULT_CAPS)


def batch(step: int, phase: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Ids and float32 gradients of one step, a pure function of (step, phase).

    Table s gets gradients that are multiples of 1/4 in [-1, 1]: with lr 1/2 and init 1/4 every
    SGD update is exact in float32, so the model can be compared bit for bit.
    """
    rng = np.random.default_rng([step, PHASES.index(phase)])
    hot = caps(phase)[2]
    s_ids = rng.integers(0, hot, BATCH) * S_STRIDE
    s_g = (rng.integers(-4, 5, (BATCH, 4)) / 4).astype(np.float32)
    a_ids = (rng.random(BATCH) ** 2 * 5000).astype(np.int64)
    a_g = rng.standard_normal((BATCH, 4)).astype(np.float32)
    return {"s": (s_ids, s_g), "a": (a_ids, a_g)}


def open_store(path: str | Path, phase: str) -> ts.TierStore:
    """The store a phase trains."""
    d, h, _ = caps(phase)
    return ts.TierStore(path, SPECS, device_capacity=d, host_capacity=h, seed=SEED, device="cpu",
                        **as_format.options())


def train(store: ts.TierStore, step: int, phase: str) -> None:
    """Apply one step's batch to both tables."""
    for name, (ids, g) in batch(step, phase).items():
        store.apply(name, torch.from_numpy(ids), torch.from_numpy(g))


def run(phase: str, root: Path) -> None:
    """The loop of one phase; acknowledgements go to root/acks. Runs until killed."""
    acks = open(root / "acks", "a", buffering=1)

    def ack(line: str) -> None:
        acks.write(line + "\n")
        acks.flush()

    store = open_store(root / "store", phase)
    step = 0
    n = 0
    if phase == "import":  # an export to import from, acknowledged before the loop
        for step in range(1, 4):
            ack(f"T {step}")
            train(store, step, phase)
        export_store(store, root / "exp")
        ack(f"E {step}")
    while True:
        step += 1
        n += 1
        if phase == "import":
            ack(f"B {step}")
            import_store(root / "exp", root / f"imp-{n}")
            ack(f"I {3} imp-{n}")
            continue
        ack(f"T {step}")
        train(store, step, phase)
        every = {"train": 5, "flush": 60, "checkpoint": 4, "overwrite": 3}.get(phase, 4)
        if step % every == 0:
            ack(f"B {step}")
        if phase == "train" and step % 5 == 0:
            store.flush()
            ack(f"F {step}")
        elif phase == "flush" and step % 60 == 0:
            store.flush()  # ~10,000 dirty rows per flush: more than one LMDB transaction
            ack(f"F {step}")
        elif phase == "checkpoint" and step % 4 == 0:
            store.checkpoint(root / f"ck-{step:05d}", step=step)
            ack(f"C {step} ck-{step:05d}")
        elif phase == "overwrite" and step % 3 == 0:
            store.checkpoint(root / "ck", step=step, overwrite=True)
            ack(f"C {step} ck")
        elif phase in ("close", "compaction") and step % 4 == 0:
            store.close()  # compaction: every close rewrites the file (see the test's env)
            ack(f"X {step}")
            store = open_store(root / "store", phase)
        elif phase == "export" and step % 4 == 0:
            export_store(store, root / "exp", overwrite=True)
            ack(f"E {step}")


def zygote() -> None:
    """Fork one child per RUN line; reap on REAP lines (see the module docstring)."""
    torch.set_num_threads(1)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "RUN":
            pid = os.fork()
            if pid == 0:  # the child: run until killed
                try:
                    sys.stdin.close()
                    run(args[0], Path(args[1]))
                except BaseException as exc:  # surfaced through the acks file
                    with open(Path(args[1]) / "acks", "a") as f:
                        f.write(f"ERROR {exc!r}\n")
                finally:
                    os._exit(1)
            print(pid, flush=True)
        elif cmd == "REAP":
            os.waitpid(int(args[0]), 0)
            print("reaped", flush=True)


if __name__ == "__main__":
    zygote()
