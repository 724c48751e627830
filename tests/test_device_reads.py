"""Host reads of device tensors on the CUDA paths, found on the CPU (`tests.devtaint`).

The sets cache's state is marked as device-resident and every torch call is watched: a read of
a device value on the host (`.item()`, `bool()`, `nonzero`, `.cpu()`, ...) would make a CUDA
host wait, and under `torch.cuda.set_sync_debug_mode("error")`, which is process-wide, raise in
whichever thread made it. The staging thread runs beside the training step, so its reads go
through `tierstore.hostread.to_host` (an event's wait, which the mode does not flag).
"""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") in (None, "", "0") and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import: kernels on CPU tensors

import tierstore as ts  # noqa: E402
from tests.devtaint import DeviceTaint, watching_hostread  # noqa: E402
from tests.feature_batches import feature_batches  # noqa: E402
from tierstore.engine import interpreting  # noqa: E402
from tierstore.prefetch import Prefetcher  # noqa: E402
from tierstore.steps import EngineStep  # noqa: E402

FEATS = {"x": "a", "y": "b", "z": "a"}
SPECS = [ts.TableSpec("a", 10**6, 8, optimizer=ts.RowWiseAdagrad(0.1)),
         ts.TableSpec("b", 500, 4, optimizer=ts.Adam(0.01, weight_decay=0.01))]
HALF = [ts.TableSpec("a", 10**6, 8, optimizer=ts.Adagrad(0.1), dtype="bfloat16"),
        ts.TableSpec("b", 500, 4, optimizer=ts.SGD(0.05), dtype="float16", clip=0.5)]


def _batches(n, batch=6, seed=2, rows=500):
    return feature_batches(n, FEATS, batch=batch, seed=seed, rows=rows)


def _pretend(mode, store):
    """Mark the sets cache's state and the device objects that name its device."""
    dev = store.device_tier
    cache = dev.cache
    mode.mark(cache.slab, *(getattr(cache, n) for n in ("_keys", "_stamp", "_lock", "_dirty")))
    mode.add_device(dev.device, cache.device, dev.index.device, store.device)
    if dev.codec.offsets is not None:
        mode.mark(dev.codec.offsets)


# a sets cache that holds every declared row maps key k to slot k (direct) and mirrors its keys
# on the host: `bench.training`'s resident configuration on CUDA
SMALL = [ts.TableSpec("a", 700, 8, optimizer=ts.RowWiseAdagrad(0.1)),
         ts.TableSpec("b", 500, 4, optimizer=ts.Adam(0.01, weight_decay=0.01))]
SMALL_HALF = [ts.TableSpec("a", 700, 8, optimizer=ts.Adagrad(0.1), dtype="bfloat16"),
              ts.TableSpec("b", 500, 4, optimizer=ts.SGD(0.05), dtype="float16", clip=0.5)]


def _watch_staging(monkeypatch, modes):
    """Run both phases of staging (the staging thread's work) under a `DeviceTaint` of its thread."""
    for name in ("prepare_batch", "finish_batch"):
        phase = getattr(Prefetcher, name)

        def watched(self, *args, phase=phase):
            mode = modes.setdefault(threading.get_ident(), DeviceTaint())
            _pretend(mode, self.store)
            with mode:
                return phase(self, *args)

        monkeypatch.setattr(Prefetcher, name, watched)


@pytest.mark.parametrize("direct", [False, True, "ahead"], ids=["evicting", "direct", "made-ahead"])
def test_staging_on_the_sets_cache_reads_device_values_only_through_hostread(tmp_path, monkeypatch,
                                                                           direct):
    modes: dict[int, DeviceTaint] = {}
    _watch_staging(monkeypatch, modes)
    # the sets cache's torch ops, the calls a CUDA run makes (on CPU tensors the store would take
    # numba's loops, `hbm_numba`, which read the tensors' memory: a path CUDA never takes)
    monkeypatch.setattr("tierstore.store.handle._set_kernels", lambda kernels, device: "torch")
    # evicting: a cache smaller than a batch's rows: staging evicts, overflows to the host tier,
    # reloads; direct: every row has its line
    kw = dict(device_capacity=2000, host_capacity=0) if direct else \
        dict(device_capacity=64, host_capacity=256, policy="lru")
    with ts.TierStore(tmp_path / "s", SMALL if direct else SPECS, device="cpu", device_cache="sets",
                      **kw) as store, watching_hostread(modes):
        assert (store.device_tier.held is not None) == bool(direct)
        ebc = ts.TieredEmbeddingBagCollection(store, FEATS)
        # made-ahead: every row in the cache first, so the pipeline stages nothing; over the
        # collection it makes each step's slots and keyed batch instead
        over = ebc if direct == "ahead" else store
        if direct == "ahead":
            for spec in SMALL:
                store.read(spec.name, torch.arange(spec.num_rows))
        with Prefetcher(over, _batches(8), depth=2, features=FEATS, extract=lambda b: b[0]) as pf:
            for sparse, weight in pf:
                (ebc(*sparse) * weight).sum().backward()
        if direct:
            assert store.prefetch_stats.lock_free_bags == 8 * 2
            assert store.prefetch_stats.steps_made_ahead == (0 if direct is True else 8)
        else:
            assert store.prefetch_stats.staged_from_host > 0  # victims went down and came back
        store.check()
    assert modes, "staging ran on no thread"
    reads = [r for m in modes.values() for r in m.reads]
    assert reads == [], "\n".join(reads)


@pytest.mark.skipif(not interpreting(), reason="triton was imported without its interpreter")
@pytest.mark.parametrize("mode,specs", [("sum", SPECS), ("mean", SPECS), ("sum", HALF),
                                         ("sum", SMALL), ("sum", SMALL_HALF), ("sequence", SPECS),
                                         ("sequence", SMALL)],
                         ids=["sum", "mean", "16-bit", "direct", "direct-16-bit", "sequence",
                              "direct-sequence"])
def test_the_staged_step_on_the_sets_cache_reads_no_device_value(tmp_path, monkeypatch, mode, specs):
    import tierstore.backends.hbm_kernels as hbm_kernels
    import tierstore.engine.triton_backend as triton_backend

    for mod in (hbm_kernels, triton_backend):  # the interpreter reads its arguments on the host
        launching = mod.launching

        @contextlib.contextmanager
        def quiet(launching=launching):
            with launching(), torch._C.DisableTorchFunction():
                yield

        monkeypatch.setattr(mod, "launching", quiet)
    modes: dict[int, DeviceTaint] = {}
    # a mode sees `EngineStep.apply` as one call and runs it (and autograd the backward) with
    # no mode: the step's own calls are watched by entering the mode again inside them
    def watching(step, grads=False):
        def watched(*args):
            mode = modes.get(threading.get_ident())
            if mode is not None and grads:  # autograd's output gradient is on the device
                mode.mark(*[a for a in args if isinstance(a, torch.Tensor)])
            with mode if mode is not None else contextlib.nullcontext():
                return step(*args)
        return staticmethod(watched)

    monkeypatch.setattr(EngineStep, "forward", watching(EngineStep.forward))
    monkeypatch.setattr(EngineStep, "backward", watching(EngineStep.backward, grads=True))
    direct = specs in (SMALL, SMALL_HALF)  # the cache holds every row: key k at slot k
    _watch_staging(monkeypatch, modes)  # and staging beside the step, as CUDA's debug mode does
    with ts.TierStore(tmp_path / "s", specs, device="cpu", kernels="triton", device_cache="sets",
                      device_capacity=2048, host_capacity=0 if direct else 64, policy="lru") as store, \
            watching_hostread(modes):
        assert (store.device_tier.held is not None) == direct
        if mode == "sequence":  # the unpooled step (one row an id)
            seq = ts.TieredEmbeddingCollection(store, FEATS)

            def loss(sparse, weight):
                vals = [e.values() for e in seq(*sparse).values()]
                return sum((v * weight[0, : v.shape[1]]).sum() for v in vals)
        else:
            ebc = ts.TieredEmbeddingBagCollection(store, FEATS, mode=mode)

            def loss(sparse, weight):
                return (ebc(*sparse) * weight).sum()
        with Prefetcher(store, _batches(6), depth=2, features=FEATS, extract=lambda b: b[0]) as pf:
            for i, (sparse, weight) in enumerate(pf):
                taint = DeviceTaint()
                _pretend(taint, store)
                weight = weight.to(store.device, non_blocking=True)
                with taint if i >= 2 else contextlib.nullcontext():  # plan tensors cached by then
                    modes[threading.get_ident()] = taint
                    loss(sparse, weight).backward()
                    modes.pop(threading.get_ident())
                assert taint.reads == [], "\n".join(taint.reads)
        assert store.prefetch_stats.lock_free_bags == 6 * 2  # every step took the staged path
    assert modes, "staging ran unwatched"
    staging = [r for m in modes.values() for r in m.reads]  # the staging thread's
    assert staging == [], "\n".join(staging)


def _warm_only_run(path, backward_elsewhere):
    """Prefetched steps whose windows never fit the cache (warm-only batches), with each
    backward on the consumer's thread or, as autograd runs a CUDA step's, on another one."""
    specs = [ts.TableSpec("a", 5000, 8, optimizer=ts.Adagrad(0.1)),
             ts.TableSpec("b", 300, 4, optimizer=ts.SGD(0.1))]
    with ts.TierStore(path, specs, device="cpu", device_capacity=24, host_capacity=0,
                      policy="hlfu", staging_capacity=0) as store:
        ebc = ts.TieredEmbeddingBagCollection(store, FEATS)
        with Prefetcher(store, _batches(6, batch=8, seed=5, rows=300), depth=2, features=FEATS,
                        extract=lambda b: b[0]) as pf:
            for sparse, weight in pf:
                loss = (ebc(*sparse) * weight).sum()
                if backward_elsewhere:
                    t = threading.Thread(target=loss.backward)
                    t.start()
                    t.join()
                else:
                    loss.backward()
        assert store.prefetch_stats.warm_only > 0
        tabs, rows = store.device_tier.resident()
        held = sorted(zip(tabs.tolist(), rows.tolist()))
        return held, {t: store.read(t, torch.arange(300)) for t in ("a", "b")}


def test_a_backward_on_another_thread_moves_rows_as_on_the_consumers(tmp_path):
    here = _warm_only_run(tmp_path / "here", False)
    there = _warm_only_run(tmp_path / "there", True)
    assert here[0] == there[0]  # the same rows cached: placement follows the consumer's batch
    for t in here[1]:
        assert torch.equal(here[1][t], there[1][t]), t
