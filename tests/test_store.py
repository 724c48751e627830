"""Store behaviour: lazy init, huge tables, errors that change nothing, reopen, stats, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import tierstore as ts
from tests import reference as ref
from tierstore.cli import main as cli_main

BIG = 10**11


def _open(path, specs, dev=4, host=8, **kw):
    return ts.TierStore(path, specs, device_capacity=dev, host_capacity=host, device="cpu", **kw)


def test_lazy_init_is_pure_function_of_seed_table_row(tmp_path):
    spec = ts.TableSpec("t", BIG, 16)
    ids = torch.tensor([0, 1, 12345, BIG - 1, 77, 77])
    with _open(tmp_path / "a", [spec], dev=1, host=0) as a, \
         _open(tmp_path / "b", [spec], dev=100, host=100) as b:
        ra = a.read("t", ids)
        rb = b.read("t", ids.flip(0)).flip(0)
        assert torch.equal(ra, rb)
        assert torch.equal(ra[4], ra[5])
        bound = 1 / 16**0.5
        assert float(ra.abs().max()) <= bound and float(ra.std()) > 0.1 * bound
    # another seed or table name gives other values; reading stores nothing
    with _open(tmp_path / "c", [spec], seed=1) as c:
        assert not torch.equal(c.read("t", ids), ra)
        assert c.stats()["ssd"]["rows_stored"] == 0
    with _open(tmp_path / "d", [ts.TableSpec("u", BIG, 16)]) as d:
        assert not torch.equal(d.read("u", ids), ra)


def test_lazy_init_values_are_fixed_across_versions(tmp_path):
    """Pin values as literals: a change to the hash would silently change every untouched row."""
    with _open(tmp_path / "s", [ts.TableSpec("t", BIG, 4)], seed=0) as s:
        got = s.read("t", torch.tensor([0, 77]))
    # float32 bit patterns written down once (see tests/test_reference_math.py for more pins)
    assert got.numpy().view(np.uint32)[1, 1] == 0xBECBDD7E
    assert len(np.unique(got.numpy())) == 8 and float(got.abs().max()) <= 0.5


def test_initializers(tmp_path):
    specs = [ts.TableSpec("n", 1000, 64, init=ts.NormalInit(std=0.1)),
             ts.TableSpec("c", 1000, 4, init=ts.ConstantInit(0.25)),
             ts.TableSpec("u", 1000, 4, init=ts.UniformInit(bound=2.0))]
    with _open(tmp_path / "s", specs) as s:
        n = s.read("n", torch.arange(1000))
        assert abs(float(n.std()) - 0.1) < 0.01 and abs(float(n.mean())) < 0.01
        assert torch.equal(s.read("c", torch.arange(3)), torch.full((3, 4), 0.25))
        u = s.read("u", torch.arange(1000))
        assert float(u.abs().max()) <= 2.0 and float(u.abs().max()) > 1.9


def test_huge_table_ids_spread_over_whole_range(tmp_path):
    spec = ts.TableSpec("t", BIG, 8, optimizer=ts.RowWiseAdagrad(0.1))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, BIG, (5000,), generator=gen)
    ids[:2] = torch.tensor([0, BIG - 1])
    grads = torch.randn(5000, 8, generator=gen)
    with _open(tmp_path / "s", [spec], dev=100, host=1000) as s:
        before = s.read("t", ids)
        s.apply("t", ids, grads)
        after = s.read("t", ids)
        assert not torch.equal(before, after)
        assert s.stats()["writeback"]["rows_in"] > 3000  # overflow rows went down (ring, log)
        s.flush()
        assert s.stats()["ssd"]["rows_stored"] > 3000  # ... and into LMDB's tables
    with _open(tmp_path / "s", [spec], dev=10, host=10) as s:
        assert torch.equal(s.read("t", ids), after)
        assert s.stats()["ssd"]["rows_stored"] == ids.unique().numel()


def test_max_row_count_table(tmp_path):
    spec = ts.TableSpec("t", 2**63 - 1, 2)
    with _open(tmp_path / "s", [spec]) as s:
        ids = torch.tensor([2**63 - 2, 0])
        s.apply("t", ids, torch.ones(2, 2))
        assert s.read("t", ids).shape == (2, 2)


def _snapshot(store, specs, ids):
    return {sp.name: store.cascade.access(store.tables[sp.name], ids, None).clone() for sp in specs}


@pytest.mark.parametrize("bad_call", [
    lambda s: s.read("nope", torch.tensor([1])),
    lambda s: s.apply("t", torch.tensor([1, -1]), torch.ones(2, 4)),
    lambda s: s.apply("t", torch.tensor([1, 50]), torch.ones(2, 4)),
    lambda s: s.apply("t", torch.tensor([1.0, 2.0]), torch.ones(2, 4)),
    lambda s: s.apply("t", torch.tensor([[1, 2]]), torch.ones(2, 4)),
    lambda s: s.apply("t", torch.tensor([1, 2]), torch.ones(2, 5)),
    lambda s: s.apply("t", torch.tensor([1, 2]), torch.ones(3, 4)),
    lambda s: s.apply("t", torch.tensor([1, 2]), torch.ones(2, 4, dtype=torch.int64)),
    lambda s: s.apply("t", torch.tensor([1, 2]), [[1.0] * 4] * 2),
    lambda s: s.read("t", "abc"),
    lambda s: s.apply_unique("t", torch.tensor([3, 1]), torch.ones(2, 4)),
])
def test_bad_input_raises_and_changes_nothing(tmp_path, bad_call):
    specs = [ts.TableSpec("t", 50, 4, optimizer=ts.Adam(0.1))]
    with _open(tmp_path / "s", specs, dev=3, host=3) as s:
        s.apply("t", torch.arange(10), torch.randn(10, 4))
        before = _snapshot(s, specs, torch.arange(50))
        with pytest.raises(ts.TierstoreError):
            bad_call(s)
        assert torch.equal(_snapshot(s, specs, torch.arange(50))["t"], before["t"])
        s.check()


def test_error_classes(tmp_path):
    specs = [ts.TableSpec("t", 50, 4)]
    with _open(tmp_path / "s", specs) as s:
        with pytest.raises(ts.UnknownTableError):
            s.read("x", torch.tensor([1]))
        with pytest.raises(ts.InvalidIdsError):
            s.read("t", torch.tensor([50]))
        with pytest.raises(ts.InvalidIdsError):
            s.read("t", torch.tensor([0.5]))
        with pytest.raises(ts.ShapeError):
            s.apply("t", torch.tensor([1]), torch.ones(1, 3))
        with pytest.raises(ts.StoreLockedError):
            _open(tmp_path / "s", specs)
    with pytest.raises(ts.StoreClosedError):
        s.read("t", torch.tensor([1]))
    for bad in [dict(num_rows=0), dict(num_rows=2**63), dict(dim=0), dict(name="a b"),
                dict(dtype="int8"), dict(optimizer="sgd")]:
        with pytest.raises(ts.ConfigError):
            ts.TableSpec(**{"name": "t", "num_rows": 5, "dim": 2, **bad})
    with pytest.raises(ts.ConfigError):
        _open(tmp_path / "p", specs, policy="nope")
    with pytest.raises(ts.ConfigError):
        ts.TierStore(tmp_path / "q", specs, device_capacity="lots", host_capacity=1)
    with pytest.raises(ts.ConfigError):
        ts.TierStore(tmp_path / "q", specs, device_capacity=-1, host_capacity=1)
    with pytest.raises(ts.ConfigError):
        ts.Adagrad(lr=float("nan"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ts.TierstoreError):
        _open(tmp_path / "file", specs)


@pytest.mark.parametrize("change", [dict(dim=5), dict(optimizer=ts.Adagrad()),
                                    dict(num_rows=51), dict(init=ts.NormalInit())])
def test_reopen_with_other_config_is_refused(tmp_path, change):
    spec = ts.TableSpec("t", 50, 4)
    with _open(tmp_path / "s", [spec]) as s:
        s.apply("t", torch.arange(5), torch.ones(5, 4))
        want = s.read("t", torch.arange(50))
    other = ts.TableSpec(**{"name": "t", "num_rows": 50, "dim": 4, **change})
    with pytest.raises(ts.ConfigMismatchError):
        _open(tmp_path / "s", [other])
    with pytest.raises(ts.ConfigMismatchError):
        _open(tmp_path / "s", [spec], seed=3)
    # nothing damaged, and the lock was released by the failed opens
    with _open(tmp_path / "s", [spec, ts.TableSpec("new", 3, 2)], add_tables=True) as s:
        assert torch.equal(s.read("t", torch.arange(50)), want)
        s.read("new", torch.tensor([1]))


def test_optimizer_hyperparameters_may_change_on_reopen(tmp_path):
    with _open(tmp_path / "s", [ts.TableSpec("t", 50, 4, optimizer=ts.SGD(0.1))]) as s:
        s.apply("t", torch.tensor([1]), torch.ones(1, 4))
        w = s.read("t", torch.tensor([1]))
    with _open(tmp_path / "s", [ts.TableSpec("t", 50, 4, optimizer=ts.SGD(0.01))]) as s:
        s.apply("t", torch.tensor([1]), torch.ones(1, 4))
        assert torch.equal(s.read("t", torch.tensor([1])), w - 0.01)


def test_capacities_as_sizes_and_stats(tmp_path):
    # payload 32 floats + the last-update stamp column = 33 floats = 132 B per cached row
    spec = ts.TableSpec("t", 10**6, 16, optimizer=ts.Adagrad())
    with ts.TierStore(tmp_path / "s", [spec], device_capacity="4KiB", host_capacity="1MiB",
                      device="cpu", policy="lru") as s:  # a named policy: two tiers as given
        st = s.stats()
        assert st["device"]["capacity"] == 4096 // 132 == 31 and st["host"]["capacity"] == 2**20 // 132
        s.read("t", torch.arange(100))
        s.read("t", torch.arange(100))
        st = s.stats()
        assert st["device"]["lookups"] == 200 and st["device"]["hits"] == 31
        assert st["host"]["hits"] == 69 and st["ssd"]["lookups"] == 100
        assert st["ssd"]["hits"] == 0 and st["ssd"]["bytes_written"] == 0  # clean rows not written
        s.apply("t", torch.arange(100), torch.ones(100, 16))
        s.flush()
        st = s.stats()
        assert st["ssd"]["rows_stored"] == 100 and st["ssd"]["bytes_written"] >= 100 * 128
        for tier in ("device", "host", "ssd"):
            for key in ("lookups", "hits", "misses", "insertions", "evictions", "writebacks",
                        "bytes_read", "bytes_written"):
                assert key in st[tier]


def test_batches_larger_than_every_cache(tmp_path):
    spec = ts.TableSpec("t", 1000, 4, optimizer=ts.Adagrad(0.5))
    ids = torch.arange(0, 1000, 3)
    g = torch.randn(ids.numel(), 4)
    with _open(tmp_path / "a", [spec], dev=1, host=2) as a, \
         _open(tmp_path / "b", [spec], dev=5000, host=0) as b:
        a.apply("t", ids, g)
        b.apply("t", ids, g)
        assert torch.equal(a.read("t", ids), b.read("t", ids))
        a.check()


def test_cli_info(tmp_path, capsys):
    with _open(tmp_path / "s", [ts.TableSpec("t", BIG, 4)]) as s:
        s.apply("t", torch.tensor([1, 2, 3]), torch.ones(3, 4))
    assert cli_main(["info", str(tmp_path / "s"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tables"][0]["rows_stored"] == 3 and report["tables"][0]["num_rows"] == BIG
    assert report["disk_bytes"] > 0
    assert cli_main(["info", str(tmp_path / "missing")]) == 2


@pytest.mark.slow
@pytest.mark.ci
def test_memory_bounded_by_capacities(tmp_path):
    code = f"""
import psutil, torch, tierstore as ts
spec = ts.TableSpec("t", 10**11, 32, optimizer=ts.RowWiseAdagrad(0.1))
with ts.TierStore({str(tmp_path / 's')!r}, [spec], device_capacity=10_000,
                  host_capacity=100_000, device="cpu") as s:
    s.read("t", torch.arange(1000))
    proc = psutil.Process()
    m = proc.memory_info()
    base = m.rss - m.shared
    gen = torch.Generator().manual_seed(0)
    for i in range(100):
        ids = torch.randint(0, 10**11, (20_000,), generator=gen)
        s.apply("t", ids, torch.ones(20_000, 32))
    m = proc.memory_info()
    # anonymous memory only: LMDB's mmap'd file pages are page cache the kernel can reclaim
    print((m.rss - m.shared - base) / 2**20)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    grown_mib = float(out.stdout.strip().splitlines()[-1])
    caches_mib = 110_000 * 33 * 4 / 2**20
    assert grown_mib < caches_mib + 200, grown_mib


def test_store_records_requested_ids(tmp_path):
    from tierstore.traces import read_recording

    specs = [ts.TableSpec("a", BIG, 2), ts.TableSpec("b", 10, 2)]
    rec = tmp_path / "run.tsrec"
    with _open(tmp_path / "s", specs, record=rec) as s:
        s.read("a", torch.tensor([5, BIG - 1, 5]))
        g = s.gather("b", torch.tensor([3, 1]))
        s.apply_unique("b", g.unique, torch.ones(2, 2))  # backward of a gather: not a new request
        s.apply("a", torch.tensor([7]), torch.ones(1, 2))
    trace = read_recording(rec)
    names = [trace.table_names[i] for i in trace.tables]
    assert names == ["a", "a", "a", "b", "b", "a"]
    assert trace.rows.tolist() == [5, BIG - 1, 5, 3, 1, 7]


def test_init_by_name(tmp_path):
    assert ts.TableSpec("t", 5, 2, init="normal").init == ts.NormalInit()
    assert ts.TableSpec("t", 5, 2, init="constant").init == ts.ConstantInit()
    with pytest.raises(ts.ConfigError):
        ts.TableSpec("t", 5, 2, init="xavier")


def test_second_process_cannot_open_for_writing(tmp_path):
    spec = ts.TableSpec("t", 50, 4)
    with _open(tmp_path / "s", [spec]) as s:
        s.apply("t", torch.tensor([1]), torch.ones(1, 4))
        s.flush()
        code = f"""
import tierstore as ts
try:
    ts.TierStore({str(tmp_path / 's')!r}, [ts.TableSpec("t", 50, 4)], device_capacity=1,
                 host_capacity=1, device="cpu")
except ts.StoreLockedError as exc:
    print("locked:", exc)
"""
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.startswith("locked:"), out.stdout + out.stderr
        # the lock refused the second writer and left this one's update in place
        want = ref.lazy_row(spec, 0, 1).astype(np.float64) - 0.01 * 1.0  # SGD(lr=0.01), grad 1
        np.testing.assert_allclose(s.read("t", torch.tensor([1]))[0].double().numpy(), want, atol=1e-7)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == ""  # free again once closed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda_is_a_config_error(tmp_path):
    for device in ("cuda", "tpu:7"):
        with pytest.raises(ts.ConfigError):
            ts.TierStore(tmp_path / "s", [ts.TableSpec("t", 5, 2)], device_capacity=1,
                         host_capacity=1, device=device)


def test_bad_record_path_is_a_config_error_and_releases_the_lock(tmp_path):
    spec = ts.TableSpec("t", 5, 2)
    before = set(threading.enumerate())
    with pytest.raises(ts.ConfigError):
        _open(tmp_path / "s", [spec], record=tmp_path / "no" / "such" / "dir" / "x.tsrec")
    # nor is a thread it started (writer, merger) left running
    assert not [t for t in threading.enumerate() if t not in before]
    with _open(tmp_path / "s", [spec]) as s:  # not locked by the failed open
        s.read("t", torch.tensor([1]))


def test_apply_fast_path_matches_the_reference_and_handles_repeats(tmp_path):
    from tests.reference import DictStore

    spec = ts.TableSpec("t", BIG, 6, optimizer=ts.RowWiseAdagrad(0.3))
    model = DictStore([spec])
    gen = torch.Generator().manual_seed(3)
    ids = torch.tensor([9, BIG - 1, 4, 70, 5])
    with _open(tmp_path / "s", [spec], dev=16, host=0) as s:
        s.read("t", ids)  # every row device-resident from here on
        lookups = s.stats()["device"]["lookups"]
        for batch in (ids, ids.flip(0), torch.tensor([4, 9, 4, 70, 9]), ids[:2]):
            g = torch.randn(batch.numel(), 6, generator=gen)
            s.apply("t", batch, g)
            model.apply("t", batch, g)
            assert s.cascade.last_sources == (batch.unique().numel(), 0, 0)  # no row moved
        st = s.stats()
        assert st["device"]["lookups"] - lookups == 5 + 5 + 3 + 2 and st["device"]["misses"] == 5
        got = s.cascade.access(s.tables["t"], ids.sort().values, None)[:, : spec.payload_dim]
        assert torch.equal(got, model.payloads("t", ids.sort().values))
        # bad input on a resident batch raises and changes nothing
        with pytest.raises(ts.ShapeError):
            s.apply("t", ids, torch.ones(5, 7))
        with pytest.raises(ts.InvalidIdsError):
            s.apply("t", torch.tensor([4, -2]), torch.ones(2, 6))
        rows = s.cascade.access(s.tables["t"], ids.sort().values, None)
        assert torch.equal(rows[:, : spec.payload_dim], got)
        s.check()


def test_clean_rows_leave_the_cache_without_a_write_and_dirty_ones_are_written_once(tmp_path):
    spec = ts.TableSpec("t", 10**6, 4, optimizer=ts.SGD(0.1))
    with _open(tmp_path / "s", [spec], dev=8, host=8, policy="lru") as s:
        for lo in range(0, 400, 40):  # clean rows cascade device -> host -> dropped
            s.read("t", torch.arange(lo, lo + 40))
        st = s.stats()
        assert st["ssd"]["writebacks"] == 0 and st["ssd"]["rows_stored"] == 0
        assert st["host"]["evictions"] > 0 and st["host"]["writebacks"] == 0
        # 30 dirty rows: 8 fit the device tier, the host tier takes the device's 8 victims, so
        # 22 overflow straight to LMDB
        s.apply("t", torch.arange(1000, 1030), torch.ones(30, 4))
        assert s.stats()["ssd"]["writebacks"] == 22
        s.read("t", torch.arange(2000, 2016))  # the 8 dirty device rows move to the host tier
        assert s.stats()["ssd"]["writebacks"] == 22
        s.read("t", torch.arange(3000, 3016))  # ... and from there to LMDB
        st = s.stats()
        assert st["ssd"]["writebacks"] == 30 and st["writeback"]["rows_in"] == 30
        s.flush()  # no dirty row is cached any more: the flush only drains the write-behind
        assert s.stats()["ssd"]["rows_stored"] == 30 and s.stats()["writeback"]["rows_in"] == 30
        # the rows written back and read again from LMDB hold the update: w0 - 0.1 * 1
        want = np.stack([ref.lazy_row(spec, 0, r) for r in range(1000, 1030)]).astype(np.float64) - 0.1
        np.testing.assert_allclose(s.read("t", torch.arange(1000, 1030)).double().numpy(), want,
                                   atol=1e-7)  # float32 rounding of w - 0.1
        s.check()
