"""16-bit row storage: stochastic rounding properties, placement invariance, config, bytes."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import tierstore as ts
from tests.profiles import examples
from tierstore.precision import CODECS

HALF = ["bfloat16", "float16"]
OPTS = {"sgd": ts.SGD(0.3), "adagrad": ts.Adagrad(0.3), "rowwise": ts.RowWiseAdagrad(0.3),
        "adam": ts.Adam(0.05)}


def _neighbour_toward(r: torch.Tensor, x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """The 16-bit value next to r on x's side (r itself when r == x)."""
    bits = r.to(dt).view(torch.int16).to(torch.int32) & 0xFFFF
    sign, mag = bits & 0x8000, bits & 0x7FFF
    step = torch.where(x.abs() > r.abs(), 1, torch.where(x.abs() < r.abs(), -1, 0))
    nb = (sign | (mag + step).clamp(min=0)).to(torch.int16).view(dt)
    return nb.float()


@pytest.mark.parametrize("dtype", HALF)
@settings(max_examples=examples())
@given(vals=st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=40),
       olds=st.lists(st.floats(-10, 10, width=32), min_size=40, max_size=40))
def test_stochastic_rounding_picks_a_bracketing_neighbour(dtype, vals, olds):
    codec = CODECS[dtype]
    x = torch.tensor([vals], dtype=torch.float32)
    old = codec.encode(torch.tensor([olds[: x.shape[1]]], dtype=torch.float32))
    r = codec.decode(codec.encode_stochastic(x, old), x.shape[1])
    assert torch.equal(r.to(codec.torch_dtype).float(), r)  # representable
    nb = _neighbour_toward(r, x, codec.torch_dtype)
    lo, hi = torch.minimum(r.abs(), nb.abs()), torch.maximum(r.abs(), nb.abs())
    assert bool(((x.abs() >= lo) & (x.abs() <= hi)).all())  # r and its neighbour bracket x
    exact = x.to(codec.torch_dtype).float() == x
    assert torch.equal(r[exact], x[exact])  # representable values stay exact
    assert torch.equal(codec.encode_stochastic(x, old), codec.encode_stochastic(x, old))


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_rounding_is_unbiased(dtype):
    codec = CODECS[dtype]
    n = 30_000  # distinct finite 16-bit old values: a different salt per sample
    olds = codec._pack(codec._from_bits(torch.arange(n).reshape(n, 1)))
    for value in (0.1234567, -3.3333, 1e-3 / 3):
        value = float(torch.tensor(value, dtype=torch.float32))
        x = torch.full((n, 1), value)
        r = codec.decode(codec.encode_stochastic(x, olds), 1).double()
        down, up = float(r.min()), float(r.max())
        assert down <= value <= up and up > down
        sigma = (up - down) / 2 / n**0.5
        assert abs(float(r.mean()) - value) < 5 * sigma
        nearest = float(x[:1].to(codec.torch_dtype).double())
        if abs(nearest - value) > 10 * sigma:  # SR beats round-to-nearest on the mean
            assert abs(float(r.mean()) - value) < abs(nearest - value)


def _train(path, spec, caps, steps=12, reopen_at=None):
    """A few module + apply steps; returns every touched row and the store's stats."""
    gen = torch.Generator().manual_seed(4)
    store = ts.TierStore(path, [spec], device_capacity=caps[0], host_capacity=caps[1], device="cpu")
    try:
        for step in range(steps):
            if step == reopen_at:
                store.close()
                store = ts.TierStore(path, [spec], device_capacity=caps[0], host_capacity=caps[1],
                                     device="cpu")
            bag = ts.TieredEmbeddingBag(store, "t", mode="mean")
            ids = torch.randint(0, 40, (24,), generator=gen)
            out = bag(ids, torch.arange(0, 24, 4))
            (out * torch.randn(out.shape, generator=gen)).sum().backward()
            store.apply("t", ids[:5], torch.randn(5, spec.dim, generator=gen))
        return store.read("t", torch.arange(45)), store.stats()
    finally:
        store.close()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("opt", sorted(OPTS))
def test_half_tables_are_placement_invariant(tmp_path, dtype, opt):
    spec = ts.TableSpec("t", 1000, 7, optimizer=OPTS[opt], dtype=dtype)
    runs = [_train(tmp_path / f"{i}", spec, caps, reopen_at=ro)
            for i, (caps, ro) in enumerate([((100, 100), None), ((3, 2), None), ((0, 0), None),
                                            ((1, 4), 6)])]
    for rows, _ in runs[1:]:
        assert torch.equal(rows, runs[0][0])
    rows = runs[0][0]
    assert torch.equal(rows.to(getattr(torch, dtype)).float(), rows)


@pytest.mark.parametrize("dtype", HALF)
def test_half_lazy_rows_round_to_nearest_and_halve_the_payload(tmp_path, dtype):
    init = ts.UniformInit(0.5)
    f32 = ts.TableSpec("t", 10**11, 9, optimizer=ts.RowWiseAdagrad(0.1), init=init)
    half = ts.TableSpec("t", 10**11, 9, optimizer=ts.RowWiseAdagrad(0.1), init=init, dtype=dtype)
    assert half.payload_dim == 5 + 1 and f32.payload_dim == 9 + 1
    ids = torch.tensor([0, 7, 10**11 - 1, 123456789])
    with ts.TierStore(tmp_path / "a", [f32], device_capacity=2, host_capacity=2) as a, \
            ts.TierStore(tmp_path / "b", [half], device_capacity=2, host_capacity=2) as b:
        want = a.read("t", ids).to(getattr(torch, dtype)).float()
        assert torch.equal(b.read("t", ids), want)
        b.apply("t", torch.arange(50), torch.ones(50, 9))
        b.flush()
        # each row goes to the write-behind log (16-B header, row, check word; a chunk of rows adds
        # an 8-B key and a 16-B chunk header), then the flush merges it into its table (8-B key,
        # row, check word)
        record = 4 * half.row_dim + 4
        st = b.stats()
        chunks = st["writeback"]["log_chunks"]
        assert 1 <= chunks <= 50
        assert st["ssd"]["bytes_written"] == 50 * ((16 + record) + (8 + record)) + chunks * (8 + 16)


def test_dtype_is_checked_on_open_and_reopen(tmp_path):
    with pytest.raises(ts.ConfigError, match="dtype"):
        ts.TableSpec("t", 10, 4, dtype="int8")
    ts.TierStore(tmp_path / "s", [ts.TableSpec("t", 10, 4, dtype="bfloat16")], device_capacity=2,
                 host_capacity=2).close()
    with pytest.raises(ts.ConfigMismatchError, match="dtype"):
        ts.TierStore(tmp_path / "s", [ts.TableSpec("t", 10, 4, dtype="float16")])


@pytest.mark.parametrize("dtype", HALF)
def test_half_training_tracks_float32(tmp_path, dtype):
    """The accuracy cost: 16-bit weights stay close to a float32 run of the same steps."""
    rows = {}
    for dt in ("float32", dtype):
        spec = ts.TableSpec("t", 1000, 16, optimizer=ts.RowWiseAdagrad(0.05), dtype=dt)
        rows[dt], _ = _train(tmp_path / dt, spec, (100, 100), steps=30)
    ref, got = rows["float32"], rows[dtype]
    rel = float((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    ulp = 2.0**-8 if dtype == "bfloat16" else 2.0**-11  # relative spacing of the format
    assert rel < 4 * ulp


@pytest.mark.parametrize("dtype", HALF)
def test_half_torch_update_path_matches_kernels_to_one_16bit_step(tmp_path, dtype):
    """The two update paths' float32 results may differ in the last bits, so stochastic rounding
    may pick the other neighbour: the stored 16-bit patterns are equal or adjacent, never further."""
    spec = ts.TableSpec("t", 100, 6, optimizer=ts.Adagrad(0.2), dtype=dtype)
    ids = torch.arange(20)
    grads = torch.randn(20, 6, generator=torch.Generator().manual_seed(2))
    out = []
    for fused in (True, False):
        with ts.TierStore(tmp_path / f"{fused}", [spec], device_capacity=50, host_capacity=0) as s:
            s.fused = fused
            s.apply("t", ids, grads)
            out.append(s.read("t", ids))
    dt = CODECS[dtype].torch_dtype
    a, b = (o.to(dt).view(torch.int16).to(torch.int32) for o in out)
    assert torch.equal(out[0].to(dt).float(), out[0]) and torch.equal(out[1].to(dt).float(), out[1])
    assert bool(((a - b).abs() <= 1).all())  # same sign everywhere here: adjacent patterns
    assert bool((torch.sign(out[0]) == torch.sign(out[1])).all())


def test_half_rows_survive_checkpoint_and_export(tmp_path):
    from tierstore.export import export_store, import_store

    spec = ts.TableSpec("t", 10**9, 5, optimizer=ts.Adam(0.1), dtype="bfloat16")
    ids = torch.arange(100) * 7
    with ts.TierStore(tmp_path / "a", [spec], device_capacity=3, host_capacity=3) as s:
        s.apply("t", ids, torch.randn(100, 5, generator=torch.Generator().manual_seed(0)))
        want = s.read("t", ids)
        s.checkpoint(tmp_path / "ck")
    export_store(tmp_path / "a", tmp_path / "ex")
    import_store(tmp_path / "ex", tmp_path / "b")
    with ts.TierStore(tmp_path / "b", [spec], device_capacity=3, host_capacity=3) as s:
        assert torch.equal(s.read("t", ids), want)
    with ts.TierStore.restore(tmp_path / "ck", tmp_path / "c", device_capacity=3, host_capacity=3) as s:
        assert torch.equal(s.read("t", ids), want)


@pytest.mark.parametrize("dtype", HALF)
def test_numba_and_torch_stochastic_rounding_agree_bit_for_bit(dtype, monkeypatch):
    import tierstore.precision as precision

    codec = CODECS[dtype]
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(500, 9, generator=gen) * s for s in (1e-7, 1e-3, 1.0, 1e3, 1e5)])
    x[0, :5] = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0, float("nan")])
    old = codec.encode(torch.randn(x.shape, generator=gen))
    keys = torch.randint(0, 2**62, (x.shape[0],), generator=gen)
    fast = [codec.encode_stochastic(x, old).view(torch.int32),
            codec.encode_stochastic(x, old, keys, 2**40 + 3).view(torch.int32)]
    monkeypatch.setattr(precision, "HAVE_NUMBA", False)
    slow = [codec.encode_stochastic(x, old).view(torch.int32),
            codec.encode_stochastic(x, old, keys, 2**40 + 3).view(torch.int32)]
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
    assert not torch.equal(fast[0], fast[1])  # the row ids and the update count change the bits
