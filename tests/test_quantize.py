"""Row-wise int8/int4 quantized export, served by a read-only store."""

from __future__ import annotations

import json

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis.extra.numpy import arrays

import tierstore as ts
from tierstore.cli import main as cli
from tierstore.quantize import BITS, dequantize, export_quantized, quantize, stored_width
from tierstore.serving import ReadOnlyStore


@settings(deadline=None, max_examples=60)
@given(dtype=st.sampled_from(["int8", "int4"]),
       w=st.integers(1, 6).flatmap(lambda n: st.integers(1, 13).flatmap(
           lambda d: arrays(np.float32, (n, d), elements=st.floats(-1e3, 1e3, width=32)))))
def test_round_trip_error_is_at_most_half_a_step(dtype, w):
    q = quantize(w, dtype)
    assert q.shape == (w.shape[0], stored_width(w.shape[1], dtype))
    back = dequantize(q, w.shape[1], dtype)
    step = (w.max(1) - w.min(1)) / ((1 << BITS[dtype]) - 1)
    err = np.abs(back.astype(np.float64) - w.astype(np.float64))
    # half a step, plus float32 rounding of bias + scale * code
    tol = step[:, None] / 2 + 1e-6 * (np.abs(w).max(1)[:, None] + 1)
    assert (err <= tol).all()
    assert np.array_equal(back.min(1), w.min(1))  # the minimum is stored exactly (code 0)


def test_constant_rows_are_exact():
    w = np.full((3, 5), 0.25, dtype=np.float32)
    for dtype in ("int8", "int4"):
        assert np.array_equal(dequantize(quantize(w, dtype), 5, dtype), w)


def _store(path):
    specs = [ts.TableSpec("a", 1000, 16, optimizer=ts.Adam(0.01)),
             ts.TableSpec("b", 50, 3, dtype="bfloat16")]
    store = ts.TierStore(path, specs, device_capacity=32, host_capacity=64, device="cpu", seed=4)
    gen = torch.Generator().manual_seed(0)
    store.apply("a", torch.arange(0, 1000, 2), torch.randn(500, 16, generator=gen))
    store.apply("b", torch.arange(50), torch.randn(50, 3, generator=gen))
    store.close()


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_cli_export_then_serve_dequantized(tmp_path, dtype, capsys):
    src, dest = tmp_path / "s", tmp_path / "q"
    _store(src)
    assert cli(["export", str(src), str(dest), "--dtype", dtype]) == 0
    assert "bytes/row" in capsys.readouterr().out
    manifest = json.loads((dest / "manifest.json").read_text())
    per_row = {t["name"]: t["bytes_per_row"] for t in manifest["tables"]}
    codes = 16 if dtype == "int8" else 8
    assert per_row["a"] == 8 + codes + 4  # scale, bias, the codes, the checksum: no optimizer state
    with ReadOnlyStore(src, device="cpu") as full, ReadOnlyStore(dest, device="cpu") as q:
        ids = torch.arange(1000)
        ref, got = full.read("a", ids), q.read("a", ids)
        assert got.dtype == torch.float32 and got.shape == ref.shape
        step = (ref.max(1).values - ref.min(1).values) / ((1 << BITS[dtype]) - 1)
        stored = ids % 2 == 0
        err = (got - ref).abs()
        assert bool((err[stored] <= step[stored, None] / 2 + 1e-6).all())
        assert bool((err[stored].max(1).values > 0).any())  # it really is quantized
        assert torch.equal(got[~stored], ref[~stored])  # never-written rows: their init
        hb = full.read("b", torch.arange(50))
        assert (q.read("b", torch.arange(50)) - hb).abs().max() <= hb.abs().max() / 4
        with pytest.raises(ts.ReadOnlyError):
            q.apply("a", torch.tensor([0]), torch.ones(1, 16))
        assert q.epoch is None


def test_bad_dtype_and_existing_destination(tmp_path):
    src = tmp_path / "s"
    _store(src)
    with pytest.raises(ts.ConfigError):
        export_quantized(src, tmp_path / "q", "int3")
    assert not (tmp_path / "q").exists()
    export_quantized(src, tmp_path / "q", "int8")
    with pytest.raises(ts.ConfigError):
        export_quantized(src, tmp_path / "q", "int8")
    with pytest.raises(SystemExit):
        cli(["export", str(src), str(tmp_path / "q2"), "--dtype", "fp8"])
