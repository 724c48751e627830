"""A truthful state_dict (issue 39 row 3): modules over store tables save where their tables are
(path, store id, clock, specs; never rows), load_state_dict checks it against the module's store,
and repr shows the tables."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

import tierstore as ts

SMALL = dict(device_capacity=64, host_capacity=64, device="cpu")


def _specs(dim: int = 8):
    return [ts.TableSpec("users", 10**11, dim, optimizer=ts.RowWiseAdagrad(lr=0.1)),
            ts.TableSpec("items", 1000, 4, optimizer=ts.SGD(lr=0.2))]


class Model(nn.Module):
    def __init__(self, store):
        super().__init__()
        self.ebc = ts.TieredEmbeddingBagCollection(store, {"user": "users", "item": "items"})
        self.top = nn.Linear(store.table_specs["users"].dim + 4, 1)

    def forward(self, values, lengths):
        return self.top(self.ebc(["user", "item"], values, lengths))


def _train(model, steps=3):
    opt = torch.optim.SGD(model.top.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        lengths = torch.randint(1, 3, (8,), generator=gen)
        values = torch.randint(0, 1000, (int(lengths.sum()),), generator=gen)
        opt.zero_grad()
        model(values, lengths).square().mean().backward()
        opt.step()
        model.ebc.store.advance()


def test_save_and_load_round_trip_through_torch_save(tmp_path):
    with ts.TierStore(tmp_path / "s", _specs(), **SMALL) as store:
        model = Model(store)
        _train(model)
        torch.save(model.state_dict(), tmp_path / "m.pt")
        state = model.state_dict()["ebc._extra_state"]
        assert state["path"] == str(tmp_path / "s") and state["store_id"] == store.store_id
        assert state["clock"] == store.clock == 3
        assert state["tables"]["users"]["num_rows"] == 10**11
        # a pointer, never rows: tiny, with no tensor in it, for a 10^11-row table
        assert len(pickle.dumps(state)) < 2000
        assert not any(isinstance(v, torch.Tensor) for v in state.values())
        want = {k: v.clone() for k, v in model.top.state_dict().items()}
    with ts.TierStore.open(tmp_path / "s", **SMALL) as again:  # reopened: same store, same clock
        fresh = Model(again)
        fresh.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
        for k, v in fresh.top.state_dict().items():
            assert torch.equal(v, want[k])


def test_load_refuses_another_store_other_tables_and_another_clock(tmp_path):
    with ts.TierStore(tmp_path / "a", _specs(), **SMALL) as a:
        model = Model(a)
        _train(model, 2)
        saved = model.state_dict()
        with ts.TierStore(tmp_path / "b", _specs(), **SMALL) as b:  # same specs, another store
            other = Model(b)
            with pytest.raises(ts.ConfigMismatchError, match="another store"):
                other.load_state_dict(saved)
        with ts.TierStore(tmp_path / "c", _specs(dim=16), **SMALL) as c:  # other tables
            saved_c = Model(c).state_dict()
        a.advance()  # the store moved on: its rows are not the state_dict's
        with pytest.raises(ts.ConfigMismatchError, match="at clock 3"):
            Model(a).load_state_dict(saved)
    with ts.TierStore(tmp_path / "c", _specs(dim=16), **SMALL) as c:
        bad = dict(saved_c)
        bad["ebc._extra_state"] = {**saved_c["ebc._extra_state"],
                                   "tables": {**saved_c["ebc._extra_state"]["tables"],
                                              "users": {**saved_c["ebc._extra_state"]["tables"]["users"],
                                                        "dim": 8}}}
        with pytest.raises(ts.ConfigMismatchError, match="table 'users'"):
            Model(c).load_state_dict(bad)
        with pytest.raises(ts.ConfigMismatchError, match="not a tierstore module"):
            Model(c).load_state_dict({**saved_c, "ebc._extra_state": {"x": 1}})


def test_restored_checkpoint_accepts_the_state_dict_saved_with_it(tmp_path):
    with ts.TierStore(tmp_path / "s", _specs(), **SMALL) as store:
        model = Model(store)
        _train(model, 2)
        store.checkpoint(tmp_path / "ckpt", step=2)
        torch.save(model.state_dict(), tmp_path / "m.pt")
        _train(model, 2)  # the live store moves on past the checkpoint
    restored = ts.TierStore.restore(tmp_path / "ckpt", tmp_path / "r", **SMALL)
    try:
        assert restored.store_id == torch.load(tmp_path / "m.pt", weights_only=True)[
            "ebc._extra_state"]["store_id"]
        Model(restored).load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    finally:
        restored.close()
    with ts.TierStore.open(tmp_path / "s", **SMALL) as live, pytest.raises(ts.ConfigMismatchError):
        Model(live).load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))


def test_repr_and_every_module_kind(tmp_path):
    with ts.TierStore(tmp_path / "s", _specs(), **SMALL) as store:
        mods = [ts.TieredEmbeddingBagCollection(store, {"user": "users", "item": "items"}),
                ts.TieredEmbeddingBag(store, "items", mode="mean"),
                ts.TieredEmbedding(store, "items"),
                ts.TieredEmbeddingCollection(store, ["items"])]
        for m in mods:
            text = repr(m)
            assert str(tmp_path / "s") in text and "items: 1000 x 4 sgd" in text
            sd = m.state_dict()
            assert list(sd) == ["_extra_state"] and sd["_extra_state"]["store_id"] == store.store_id
            type(m).load_state_dict(m, sd)  # its own state loads
        assert "users: 100000000000 x 8 rowwise_adagrad" in repr(mods[0])
        store.flush()
        ro = ts.TierStore.open(tmp_path / "s", readonly=True)
        try:
            assert ro.store_id == store.store_id and ro.clock == store.clock
            ts.TieredEmbeddingBagCollection(ro, ["items"]).load_state_dict(
                ts.TieredEmbeddingBagCollection(store, ["items"]).state_dict())
        finally:
            ro.close()
