"""Reads in flight for the cold regime: the reader pool switches to many threads and small tasks
when reads wait on the disk, and the bits stay the same."""

from __future__ import annotations

import threading

import torch

from tests.test_resolve import _train
from tierstore.prefetch import reads
from tierstore.prefetch.reads import COLD_PART_ROWS, ReaderPool


def test_the_pool_goes_cold_when_reads_wait_and_back_when_they_do_not():
    pool = ReaderPool(2, cold_readers=8)
    try:
        assert not pool.cold and pool.part_rows(100_000, 16384) == 16384
        pool.observe(1000, 1000 * 150e-6, 1000 * 5e-6)  # 150 us a row, mostly waiting: the disk
        assert pool.cold and pool.part_rows(100_000, 16384) == 12_500
        assert pool.part_rows(1000, 16384) == COLD_PART_ROWS
        names = {pool.submit(lambda: threading.current_thread().name).result()}
        assert all("cold" in n for n in names)
        pool.observe(1000, 1000 * 10e-6, 1000 * 1e-6)  # asked ahead: faster, still waiting
        assert pool.cold and pool.cold_batches == 2  # stays cold (COLD_STAY_ROW_S)
        pool.observe(1000, 1000 * 20e-6, 1000 * 12e-6)  # the submissions' CPU: still cold
        assert pool.cold and pool.cold_batches == 3
        pool.observe(1000, 1000 * 150e-6, 1000 * 140e-6)  # slow but on the CPU: not the disk
        assert not pool.cold
        pool.observe(1000, 1000 * 10e-6, 1000 * 1e-6)  # not cold: 10 us a row does not make it so
        assert not pool.cold
        pool.observe(1000, 1000 * 1e-6, 1000 * 0.1e-6)  # fast: the page cache
        assert not pool.cold and pool.cold_batches == 3
        pool.observe(0, 0.0, 0.0)  # nothing read: no change
        assert not pool.cold
    finally:
        pool.shutdown()
    assert ReaderPool(4, cold_readers=2).part_rows(10, 99) == 99  # no cold threads: never cold


def test_slow_reads_that_fault_nothing_are_not_cold():
    """A reader that waited for a core, not the disk, faulted no page in: the pool stays warm;
    the same wait with major faults (a leaf page every few rows) turns it cold, and it then
    stays cold by time alone while the pages asked ahead arrive without faulting."""
    pool = ReaderPool(2, cold_readers=8)
    try:
        pool.observe(1000, 1000 * 150e-6, 1000 * 5e-6, faults=0)  # waited, from the page cache
        assert not pool.cold
        pool.observe(1000, 1000 * 150e-6, 1000 * 5e-6, faults=20)  # 0.02 a row: still not
        assert not pool.cold
        pool.observe(1000, 1000 * 150e-6, 1000 * 5e-6, faults=900)  # the disk
        assert pool.cold
        pool.observe(1000, 1000 * 10e-6, 1000 * 1e-6, faults=0)  # asked ahead: stays cold
        assert pool.cold and pool.cold_batches == 2
    finally:
        pool.shutdown()


def test_a_reader_task_counts_its_threads_major_faults():
    out, wall, cpu, faults = reads._timed(sum, [1, 2, 3])
    assert out == 6 and wall >= 0 and cpu >= 0
    assert faults is None or faults >= 0  # counted where the platform can (Linux: an int)
    if reads._RUSAGE_THREAD is not None:
        assert isinstance(faults, int)


def test_cold_reads_train_the_same_bits(tmp_path, monkeypatch):
    base, _ = _train(tmp_path / "base", 2, device_capacity=4, host_capacity=8)
    monkeypatch.setattr(reads, "COLD_READERS", 8)  # on (the default is off)
    monkeypatch.setattr(reads, "COLD_ROW_S", 0.0)  # every batch's reads count as cold
    monkeypatch.setattr(reads, "COLD_STAY_ROW_S", 0.0)  # (and ask the disk ahead: ask_ahead)
    monkeypatch.setattr(reads, "COLD_CPU_SHARE", 10.0)
    monkeypatch.setattr(reads, "COLD_STAY_CPU_SHARE", 10.0)
    monkeypatch.setattr(reads, "COLD_FAULTS_A_ROW", 0.0)  # page-cached test rows fault nothing
    monkeypatch.setattr(reads, "COLD_PART_ROWS", 1)
    got, stats = _train(tmp_path / "cold", 2, device_capacity=4, host_capacity=8)
    assert stats["prefetch"]["cold_read_batches"] > 0
    for k in ("a", "b", "dense", "stored"):
        assert torch.equal(got[k], base[k]), k
