"""bench.cold: dropping a store's files from the page cache, and the disk's random-read IOPS."""

from __future__ import annotations

import json
import os

import torch

import tierstore as ts
from bench import training as bench_training
from bench.cold import disk_iops, drop_cache, random_read_iops, store_files


def test_a_store_s_files_are_dropped_and_its_disk_measured(tmp_path):
    with ts.TierStore(tmp_path / "s", [ts.TableSpec("t", 10**6, 16)], device_capacity=8,
                      host_capacity=8, device="cpu") as s:
        s.apply("t", torch.arange(5000), torch.ones(5000, 16))
        s.flush()
        files = store_files(tmp_path / "s")
        assert tmp_path / "s" / "data.mdb" in files
        assert drop_cache(files) == sum(os.path.getsize(p) for p in files) > 0
        one = random_read_iops(tmp_path / "s" / "data.mdb", 4, seconds=0.05)
        assert one["depth"] == 4 and one["reads"] > 0 and one["iops"] > 0
        both = disk_iops(tmp_path / "s" / "data.mdb", seconds=0.02)
        assert set(both) == {"qd1", "qd32"} and both["qd32"]["depth"] == 32
        assert torch.equal(s.read("t", torch.arange(3)), s.read("t", torch.arange(3)))


def test_bench_training_cold_smoke(tmp_path):
    rc = bench_training.main(["--cold", "--tables", "1", "--rows", "20000", "--dim", "8",
                              "--batch", "32", "--pool", "4", "--warmup", "1", "--blocks", "2",
                              "--steps", "2", "--threads", "1", "--configs", "tierstore_cache1",
                              "--iops-seconds", "0.05", "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    data = json.loads((tmp_path / "training.json").read_text())
    (rec,) = data["records"]
    cold = rec["cold"]
    assert cold["iops_qd32"] > 0 and cold["iops_qd1"] > 0
    assert cold["rows_read_per_s"] >= 0 and cold["disk_floor_ms"] >= 0
    assert cold["reads_ahead_peak"] >= 1  # the pipeline read ahead
    assert len(data["meta"]["iops"]["tierstore_cache1"]) == 2  # before and after the blocks
    assert data["meta"]["pipeline"] == {"ask_ahead": True}


def test_bench_training_pipeline_options(tmp_path):
    rc = bench_training.main(["--tables", "1", "--rows", "2000", "--dim", "8", "--batch", "16",
                              "--pool", "2", "--warmup", "1", "--blocks", "1", "--steps", "1",
                              "--threads", "1,2", "--configs", "tierstore_cache1", "--reads-ahead",
                              "3", "--ask-ahead", "off", "--out", str(tmp_path), "--no-plot"])
    assert rc == 0  # the pipeline goes on in order from one thread setting to the next
    data = json.loads((tmp_path / "training.json").read_text())
    assert data["meta"]["pipeline"] == {"ask_ahead": False, "reads_ahead": 3}
    assert [r["threads"] for r in data["records"]] == [1, 2]
