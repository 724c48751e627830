"""Trace readers, synthetic generators and the training-run recording format."""

from __future__ import annotations

import gzip
import lzma
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.profiles import needs
from tierstore.errors import ConfigError, StoreCorruptError
from tierstore.traces import (
    TraceRecorder,
    load_trace,
    read_recording,
    save_npy,
    write_oracle_general,
)

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
needs_data = needs(SHARED.exists(), "shared data not present")


@needs_data
@pytest.mark.parametrize(("name", "requests", "distinct"), [
    ("traces/cache2k_web07.trace.xz", 76118, 20484),
    ("traces/cache2k_web12.trace.xz", 95607, 13756),
    ("traces/lirs_sprite.trace.gz", 133996, 7075),
    ("traces/libcachesim_cloudPhysicsIO.txt", 113872, 48974),
])
def test_shared_traces(name, requests, distinct):
    t = load_trace(str(SHARED / name))
    assert len(t) == requests and t.dense()[1] == distinct


@needs_data
def test_raw_dtype_flag_matches_sniffing():
    path = str(SHARED / "traces/cache2k_web07.trace.xz")
    assert np.array_equal(load_trace(path, ">i4").rows, load_trace(path).rows)


@needs_data
def test_criteo_csv_and_jsonl():
    t = load_trace(str(SHARED / "criteo/criteo_sample_deepctr.csv"))
    assert len(t.table_names) == 26 and t.table_names[0] == "C1"
    assert int(t.tables.max()) == 25 and len(t) <= 200 * 26
    assert t.rows[0] == 0x05DB9164
    j = load_trace(str(SHARED / "criteo/criteo_kaggle_head_bagpipe.jsonl"))
    assert len(j) == 100 * 26 and j.dense()[1] < len(j)


def test_criteo_tsv(tmp_path):
    line = "\t".join(["1"] + ["3"] * 13 + [f"{i:08x}" for i in range(25)] + [""])
    p = tmp_path / "day_0.tsv"
    p.write_text(line + "\n" + line + "\n")
    t = load_trace(str(p))
    assert len(t) == 50 and t.dense()[1] == 25
    p2 = tmp_path / "train.txt"
    p2.write_text(line + "\n")
    assert len(load_trace("criteo:" + str(p2))) == 25


def test_synthetic_specs():
    a = load_trace("zipf:alpha=1.05,keys=1000,requests=5000,seed=1")
    b = load_trace("zipf:alpha=1.05,keys=1000,requests=5000,seed=1")
    assert np.array_equal(a.rows, b.rows) and len(a) == 5000
    assert a.rows.min() >= 0 and a.rows.max() < 1000
    top = np.bincount(a.rows).max()
    assert top > 5000 / 20  # skewed
    s = load_trace("shift:alpha=1.0,keys=1000,requests=4000,period=1000,drift=500,seed=2")
    first = np.bincount(s.rows[:1000], minlength=1000).argmax()
    last = np.bincount(s.rows[3000:], minlength=1000).argmax()
    assert first != last
    for bad in ("zipf:alpha=x", "zipf:foo=1", "unif:keys=3"):
        with pytest.raises(ConfigError):
            load_trace(bad)


def test_text_npy_raw_oracle(tmp_path):
    keys = np.array([5, 3, 5, 9, 3, 3], dtype=np.int64)
    txt = tmp_path / "t.trace.gz"
    with gzip.open(txt, "wt") as f:
        f.write("5\n3\n*\n5\n9\n*\n3\n3\n")
    assert load_trace(str(txt)).rows.tolist() == keys.tolist()
    npy = tmp_path / "t.npy"
    np.save(npy, keys.astype(np.int32))
    assert load_trace(str(npy)).rows.tolist() == keys.tolist()
    raw = tmp_path / "t.bin.xz"
    raw.write_bytes(lzma.compress(keys.astype(">i8").tobytes()))
    assert load_trace(str(raw), ">i8").rows.tolist() == keys.tolist()
    og = tmp_path / "t.oracleGeneral.bin"
    write_oracle_general(og, keys)
    assert load_trace(str(og)).rows.tolist() == keys.tolist()
    two = tmp_path / "two.npy"
    t = load_trace(str(txt))
    t.tables = np.array([0, 1, 0, 1, 0, 1])
    t.table_names = ["a", "b"]
    save_npy(two, t)
    back = load_trace(str(two))
    assert back.tables.tolist() == [0, 1, 0, 1, 0, 1] and back.dense()[1] == 4
    assert load_trace(str(txt), limit=2).rows.tolist() == [5, 3]


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError):
        load_trace(str(tmp_path / "missing.npy"))
    p = tmp_path / "f.npy"
    np.save(p, np.zeros(3, dtype=np.float32))
    with pytest.raises(ConfigError):
        load_trace(str(p))
    with pytest.raises(ConfigError):
        load_trace(str(tmp_path / "x"), ">f4") if (tmp_path / "x").write_bytes(b"\0" * 8) else 0
    with pytest.raises(ConfigError):
        load_trace("")


def test_recorder_roundtrip(tmp_path):
    path = tmp_path / "run.tsrec"
    with TraceRecorder(path, buffer_ids=4) as rec:
        rec.record("user", torch.tensor([1, 2, 3]))
        rec.record("item", torch.tensor([2**40, 7]))
        rec.record("user", torch.tensor([], dtype=torch.int64))
        rec.record("user", torch.tensor([[3, 4]]))
    t = load_trace(str(path))
    assert t.table_names == ["user", "item"]
    assert t.tables.tolist() == [0, 0, 0, 1, 1, 0, 0]
    assert t.rows.tolist() == [1, 2, 3, 2**40, 7, 3, 4]
    assert t.dense()[1] == 6
    with pytest.raises(ConfigError):
        rec.record("user", torch.tensor([1]))
    rec.close()  # idempotent


def test_recorder_rejects_bad_input_and_truncation(tmp_path):
    path = tmp_path / "r.tsrec"
    rec = TraceRecorder(path)
    with pytest.raises(ConfigError):
        rec.record("t", torch.tensor([1.5]))
    with pytest.raises(ConfigError):
        rec.record("", torch.tensor([1]))
    rec.record("t", torch.arange(100))
    rec.record("t", torch.arange(50))
    rec.close()
    data = path.read_bytes()
    path.write_bytes(data[:-5])  # a crash mid-chunk: the complete chunks survive
    assert read_recording(path).rows.tolist() == list(range(100))
    path.write_bytes(b"garbage!")
    with pytest.raises(StoreCorruptError):
        read_recording(path)
