"""Every device a store runs on: placement never changes bits on one device (invariant 2)."""

from __future__ import annotations

import torch

import tierstore as ts

SPECS = [ts.TableSpec("u", 5000, 8, optimizer=ts.RowWiseAdagrad(0.1)),
         ts.TableSpec("v", 3000, 4, optimizer=ts.Adam(0.01, weight_decay=0.01))]


def _train(path, device, dcap, hcap, steps=8, device_cache="auto"):
    """A bag collection trained for a few steps; returns every touched row's payload, on the CPU."""
    gen = torch.Generator().manual_seed(4)
    with ts.TierStore(path, SPECS, device=device, device_capacity=dcap, host_capacity=hcap,
                      write_buffer=64, device_cache=device_cache) as store:
        ebc = ts.TieredEmbeddingBagCollection(store, {"fu": "u", "fv": "v"})
        touched = {"u": set(), "v": set()}
        for _ in range(steps):
            lengths = torch.randint(0, 5, (2 * 16,), generator=gen)
            values = torch.randint(0, 2500, (int(lengths.sum()),), generator=gen)
            out = ebc(["fu", "fv"], values, lengths)
            weight = torch.randn(out.shape, generator=gen).to(out.device)
            (out * weight).sum().backward()
            n_u = int(lengths[:16].sum())
            touched["u"].update(values[:n_u].tolist())
            touched["v"].update(values[n_u:].tolist())
        store.flush()
        return {t: store.read(t, torch.tensor(sorted(ids))).cpu() for t, ids in touched.items()}


def test_placement_never_changes_bits_on_a_device(tmp_path, device):
    resident = _train(tmp_path / "a", device, "64MiB", 0)
    tiny = _train(tmp_path / "b", device, 7, 11)  # rows move through every tier and the ring
    for t in resident:
        assert torch.equal(resident[t], tiny[t]), t
    for cache, caps in (("slab", (7, 11)), ("sets", (40, 11)), ("sets", ("64MiB", 0))):
        other = _train(tmp_path / f"{cache}{caps[0]}", device, *caps, device_cache=cache)
        for t in resident:  # either device tier, any capacity: the same bits
            assert torch.equal(resident[t], other[t]), (cache, caps, t)
