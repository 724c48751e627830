"""Opens a (damaged) store in a fresh process and reads rows: the damage suite's probe.

argv: store path, mode ("ro": TierStore.open(readonly=True), "rw": the writer's open, "last":
the writer's open with damaged_log="last_flush"), expected rows (.npz with `ids` and `rows`, and
`later`: each row's newer acknowledged-or-not version, also correct after a crash). Prints one
JSON line: {"outcome": "error", "type": class name} for a TierstoreError, or {"outcome": "read",
"wrong": rows equal to neither version}. Anything else (a signal, another exception) is a crash.

`build PATH NPZ`: make a store whose writer is SIGKILLed with rows in its write-behind log.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
import torch

import tierstore as ts

SPEC = ts.TableSpec("t", 10**6, 8, optimizer=ts.SGD(0.5))


def build(path: str, npz: str, rows: int = 6000) -> None:
    """Flush version A of every row, then write version B of every row into the log; SIGKILL."""
    ids = torch.arange(rows) * 13
    s = ts.TierStore(path, SPEC, device_capacity=0, host_capacity=0, seed=3, device="cpu",
                     write_buffer=256, write_log=10**6)
    s.apply("t", ids, torch.ones(rows, 8))
    s.flush()
    a = s.read("t", ids).numpy()
    s.apply("t", ids, torch.full((rows, 8), 2.0))
    b = s.read("t", ids).numpy()
    np.savez(npz, ids=ids.numpy(), rows=a, later=b)
    for _ in range(600):  # the writer drains the ring into the log
        w = s.stats()["writeback"]
        if w["pending"] == 0 and w["log_rows"] >= rows:
            break
        time.sleep(0.01)
    print(json.dumps({"log_rows": s.stats()["writeback"]["log_rows"]}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    if sys.argv[1] == "build":
        build(sys.argv[2], sys.argv[3])
        return
    if sys.argv[1] == "many":  # a JSON list of [path, mode, npz]: one line per case, from `start`
        cases = json.loads(open(sys.argv[2]).read())
        for i in range(int(sys.argv[3]), len(cases)):
            print(json.dumps({"case": i, **probe(*cases[i])}), flush=True)
        return
    print(json.dumps(probe(sys.argv[1], sys.argv[2], sys.argv[3])))


def probe(path: str, mode: str, npz: str) -> dict:
    """Open the store at `path` (see the module docstring) and compare its rows."""
    want = np.load(npz)
    ids, rows = torch.from_numpy(want["ids"]), want["rows"]
    later = want["later"] if "later" in want.files else rows
    try:
        if mode == "ro":
            store = ts.TierStore.open(path, readonly=True)
        else:
            store = ts.TierStore.open(path, device_capacity=0, host_capacity=0, device="cpu",
                                      damaged_log="last_flush" if mode == "last" else "raise")
        try:
            got = store.read("t", ids).cpu().numpy()  # a read-only handle's default: CUDA there
        finally:
            store.close()
    except ts.TierstoreError as exc:
        return {"outcome": "error", "type": type(exc).__name__, "msg": str(exc)[-400:]}
    bits = got.view(np.uint32)
    wrong = int(((bits != rows.view(np.uint32)).any(axis=1)
                 & (bits != later.view(np.uint32)).any(axis=1)).sum())
    return {"outcome": "read", "wrong": wrong}


if __name__ == "__main__":
    main()
