"""Opens a (damaged) store in a fresh process and reads rows: the damage suite's probe.

argv: store path, mode ("ro": TierStore.open(readonly=True), "rw": the writer's open),
expected rows (.npz with `ids` and `rows`), and optionally "log" (open at the last flush).
Prints one JSON line: {"outcome": "error", "type": class name} for a TierstoreError, or
{"outcome": "read", "wrong": rows that differ from the expected ones}. Anything else (a signal,
another exception) is a crash for the suite.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

import tierstore as ts


def main() -> None:
    path, mode, want = sys.argv[1], sys.argv[2], np.load(sys.argv[3])
    ids, rows = torch.from_numpy(want["ids"]), want["rows"]
    try:
        if mode == "ro":
            store = ts.TierStore.open(path, readonly=True)
        else:
            store = ts.TierStore.open(path, device_capacity=0, host_capacity=0, device="cpu")
        try:
            got = store.read("t", ids).numpy()
        finally:
            store.close()
    except ts.TierstoreError as exc:
        print(json.dumps({"outcome": "error", "type": type(exc).__name__, "msg": str(exc)[:300]}))
        return
    wrong = int((got.view(np.uint32) != rows.view(np.uint32)).any(axis=1).sum())
    print(json.dumps({"outcome": "read", "wrong": wrong}))


if __name__ == "__main__":
    main()
