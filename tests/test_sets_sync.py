"""A training step of a batch the Prefetcher staged on the sets cache makes no call that would
synchronize a CUDA device: counted over the CUDA code path on CPU tensors (Triton's interpreter),
and, on a CUDA machine, under `torch.cuda.set_sync_debug_mode("error")`."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") in (None, "", "0") and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import: kernels on CPU tensors
triton = pytest.importorskip("triton")

import tierstore as ts  # noqa: E402
from tests.feature_batches import feature_batches  # noqa: E402
from tests.syncs import SyncCounter  # noqa: E402
from tierstore.engine import interpreting  # noqa: E402
from tierstore.errors import InvalidGradientError  # noqa: E402
from tierstore.prefetch import Prefetcher  # noqa: E402

FEATS = {"x": "a", "y": "b", "z": "a"}
SPECS = [ts.TableSpec("a", 10**6, 8, optimizer=ts.RowWiseAdagrad(0.1)),
         ts.TableSpec("b", 500, 4, optimizer=ts.Adam(0.01, weight_decay=0.01))]


def _batches(n, batch=6, seed=2):
    return feature_batches(n, FEATS, batch=batch, seed=seed)


def _staged_steps(store, steps, watch, mode="sum", ahead=False):
    """Train `steps` prefetched batches; each step after the warm-up runs inside `watch()`.
    `ahead`: the pipeline over the collection (it makes a direct store's steps ahead)."""
    ebc = ts.TieredEmbeddingBagCollection(store, FEATS, mode=mode)
    with Prefetcher(ebc if ahead else store, _batches(steps), depth=2, features=FEATS,
                    extract=lambda b: b[0]) as pf:
        for i, (sparse, weight) in enumerate(pf):
            weight = weight.to(store.device)
            with watch() if i >= 2 else contextlib.nullcontext():  # plan tensors cached by then
                out = ebc(*sparse)
                (out * weight).sum().backward()
    return ebc


@pytest.mark.skipif(not interpreting(), reason="triton was imported without its interpreter")
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_staged_step_on_sets_makes_no_syncing_call(tmp_path, mode):
    counters = []

    def watch():
        counters.append(SyncCounter())
        return counters[-1]

    with ts.TierStore(tmp_path / "s", SPECS, device="cpu", kernels="triton", device_cache="sets",
                      device_capacity=2048, host_capacity=64, policy="lru") as store:
        _staged_steps(store, 6, watch, mode)
        assert store.prefetch_stats.lock_free_bags == 6 * 2  # every step took the staged path
        store.check()
    assert len(counters) == 4
    assert [c.calls for c in counters] == [[]] * 4


# the Triton engine on CPU tensors (the interpreter), and on CUDA, where the deferred flag is
# copied into pinned memory and read at the next batch once its event says the step is done
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(
               not interpreting(), reason="triton was imported without its interpreter")),
           pytest.param("cuda", marks=pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs a CUDA device"))]


@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_staged_gradient_changes_nothing_and_is_raised_at_the_next_batch(tmp_path, device):
    with ts.TierStore(tmp_path / "n", SPECS, device=device, kernels="triton", device_cache="sets",
                      device_capacity=2048, host_capacity=64, policy="lru") as store:
        ebc = ts.TieredEmbeddingBagCollection(store, FEATS)
        with Prefetcher(store, _batches(3), depth=2, features=FEATS, extract=lambda b: b[0]) as pf:
            sparse, weight = next(pf)
            ebc(*sparse).mul(weight.to(store.device)).sum().backward()
            sparse, weight = next(pf)
            before = {t: store.cascade.access(store.tables[t], torch.arange(500), None,
                                              promote=False).cpu() for t in ("a", "b")}
            weight[0, 0] = float("nan")
            ebc(*sparse).mul(weight.to(store.device)).sum().backward()  # undone on the device
            assert store.prefetch_stats.lock_free_bags == 2 * 2  # both steps staged
            with pytest.raises(InvalidGradientError, match="discarded"):
                next(pf)
        after = {t: store.cascade.access(store.tables[t], torch.arange(500), None,
                                         promote=False).cpu() for t in ("a", "b")}
        for t in before:  # weights and optimizer state as they were
            assert torch.equal(before[t][:, :-1], after[t][:, :-1]), t


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("direct", [False, True, "ahead"], ids=["evicting", "direct", "made-ahead"])
def test_staged_step_on_cuda_sets_never_syncs(tmp_path, direct):
    def watch():
        @contextlib.contextmanager
        def mode():
            torch.cuda.set_sync_debug_mode("error")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return mode()

    # direct: a cache that holds every row (key k at slot k, a host mirror of its keys), the
    # resident store of `bench.training`; the debug mode is process-wide, so staging beside
    # the step must not sync either
    specs = [dataclasses.replace(SPECS[0], num_rows=700), SPECS[1]] if direct else SPECS
    with ts.TierStore(tmp_path / "c", specs, device="cuda", kernels="triton", device_cache="sets",
                      device_capacity=2048, host_capacity=0 if direct else 64, policy="lru") as store:
        assert (store.device_tier.held is not None) == bool(direct)
        if direct == "ahead":  # every row held first: the pipeline makes the steps ahead
            for spec in specs:
                store.read(spec.name, torch.arange(spec.num_rows))
        _staged_steps(store, 6, watch, ahead=direct == "ahead")
        assert store.prefetch_stats.lock_free_bags == 6 * 2
        assert (store.prefetch_stats.steps_made_ahead > 0) == (direct == "ahead")
        store.check()


@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_last_staged_gradient_is_raised_when_the_batches_end(tmp_path, device):
    with ts.TierStore(tmp_path / "l", SPECS, device=device, kernels="triton", device_cache="sets",
                      device_capacity=2048, host_capacity=64, policy="lru") as store:
        ebc = ts.TieredEmbeddingBagCollection(store, FEATS)
        with Prefetcher(store, _batches(1), depth=2, features=FEATS, extract=lambda b: b[0]) as pf:
            sparse, weight = next(pf)
            weight[0, 0] = float("inf")
            ebc(*sparse).mul(weight.to(store.device)).sum().backward()
            with pytest.raises(InvalidGradientError, match="discarded"):
                next(pf)  # the source is done: its last step's check is read, waiting if need be
        assert not store.paths.deferred_checks
