"""The store clock: integration.train advances it once per step, so TableSpec(ttl=K) expires rows
with no extra call (issue 39 row 9); a module training ttl tables on a clock nobody advances warns."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import tierstore as ts
from integration import train as tr
from tierstore import module_state

TINY = ["--tables", "uniform:1000000000", "--dim", "8", "--batch", "64", "--hot", "3000",
        "--device-capacity", "2000", "--host-capacity", "6000", "--bottom", "16", "--top", "16",
        "--eval-batches", "2", "--no-progress", "--threads", "1"]


@pytest.mark.parametrize("prefetch", ["0", "2"])
def test_trainer_ttl_expires_rows_without_an_extra_call(tmp_path, prefetch):
    out = tmp_path / "summary.json"
    assert tr.main([*TINY, "--steps", "24", "--ttl", "4", "--prefetch", prefetch,
                    "--run-dir", str(tmp_path / "run"), "--json", str(out)]) == 0
    expiry = json.loads(out.read_text())["expiry"]
    assert expiry["expired_cached"] + expiry["expired_rows"] > 0  # rows left the caches / LMDB
    assert set(expiry["cutoffs"].values()) == {24 - 4}  # the clock counted every step
    with ts.TierStore.open(tmp_path / "run" / "store", device="cpu", host_capacity=4096) as store:
        assert store.clock == 24 and all(s.ttl == 4 for s in store.table_specs.values())


def test_trainer_without_ttl_expires_nothing(tmp_path):
    out = tmp_path / "summary.json"
    assert tr.main([*TINY, "--steps", "8", "--run-dir", str(tmp_path / "run"), "--json", str(out)]) == 0
    expiry = json.loads(out.read_text())["expiry"]
    assert not expiry or (expiry.get("expired_cached", 0) + expiry.get("expired_rows", 0)) == 0


def test_a_still_clock_under_ttl_tables_warns_once(tmp_path, monkeypatch):
    monkeypatch.setattr(module_state, "STILL_CLOCK_FORWARDS", 3)
    specs = [ts.TableSpec("t", 100, 4, ttl=5), ts.TableSpec("u", 100, 4)]
    with ts.TierStore(tmp_path / "s", specs, device="cpu", device_capacity=64, host_capacity=64) as s:
        ebc = ts.TieredEmbeddingBagCollection(s, ["t", "u"])
        batch = (["t", "u"], torch.tensor([1, 2]), torch.tensor([1, 1]))
        with pytest.warns(UserWarning, match=r"\['t'\] have a ttl.*store.advance\(\)"):
            for _ in range(3):
                ebc(*batch).sum().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once only
            ebc(*batch).sum().backward()
        ticking = ts.TieredEmbeddingBagCollection(s, ["t"])
        s.advance()  # a clock that moves: no warning
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(4):
                ticking(["t"], torch.tensor([1]), torch.tensor([1])).sum().backward()
