"""Every formula against an independent reference: torch.optim, numpy, literal pins, statistics."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given

import tierstore as ts
from tests import reference as ref

BIG = 2**63 - 1

# (seed, table, row, column, dim) -> float32 bit pattern of UniformInit's value (default bound).
# Literal values: written down once from the definition in tests/reference.py and never recomputed.
UNIFORM_PINS = [
    (0, "t", 0, 0, 16, 0x3D3706DB),
    (0, "t", 1, 3, 16, 0x3E61886D),
    (0, "t", 12345, 15, 16, 0xBE50D971),
    (0, "t", 99_999_999_999, 7, 16, 0xBE208BC3),
    (1, "t", 0, 0, 16, 0x3E77527D),
    (7, "a", 49_999_999, 2, 8, 0xBD411EC3),
    (7, "a", 2**63 - 2, 0, 8, 0xBC875A97),
    (0, "user_id", 42, 0, 64, 0xBDABAFE0),
    (0, "user_id", 42, 63, 64, 0xBCA855EB),
    (123456789, "item", 987_654_321, 5, 32, 0x3DBDD4B0),
    (2, "x", 5, 1, 4, 0x3E8D8450),
    (0, "t", 77, 1, 4, 0xBECBDD7E),
]
# (seed, table, row, column, std) -> float32 bit pattern of NormalInit(std)'s value
NORMAL_PINS = [
    (7, "b", 0, 0, 0.5, 0xBF6D3DE5),
    (7, "b", 4999, 3, 0.5, 0xBF039A33),
    (0, "emb", 10**12, 10, 0.01, 0x3C43C405),
]


def _bits(x: float) -> int:
    return int(np.array(np.float32(x)).view(np.uint32))


def _open(path, specs, seed=0, dev=64, host=0):
    return ts.TierStore(path, specs, device_capacity=dev, host_capacity=host, seed=seed, device="cpu")


# lazy initializer ------------------------------------------------------------------------------
def test_lazy_uniform_rows_match_pinned_bit_patterns(tmp_path):
    for k, (seed, table, row, col, dim, bits) in enumerate(UNIFORM_PINS):
        with _open(tmp_path / f"s{k}", [ts.TableSpec(table, BIG, dim)], seed=seed) as s:
            got = s.read(table, torch.tensor([row]))[0, col]
        assert _bits(float(got)) == bits, (seed, table, row, col, hex(_bits(float(got))))


def test_lazy_normal_rows_match_pinned_bit_patterns(tmp_path):
    for k, (seed, table, row, col, std, bits) in enumerate(NORMAL_PINS):
        spec = ts.TableSpec(table, BIG, 16, init=ts.NormalInit(std))
        with _open(tmp_path / f"s{k}", [spec], seed=seed) as s:
            got = s.read(table, torch.tensor([row]))[0, col]
        assert _bits(float(got)) == bits, (seed, table, row, col, hex(_bits(float(got))))


def test_reference_definition_reproduces_the_pins():
    """The plain-Python definition in tests/reference.py is the one the pins were written from."""
    for seed, table, row, col, dim, bits in UNIFORM_PINS:
        assert _bits(ref.lazy_uniform(seed, table, row, col, dim)) == bits
    for seed, table, row, col, std, bits in NORMAL_PINS:
        assert _bits(ref.lazy_normal(seed, table, row, col, std)) == bits


@given(rows=st.lists(st.integers(0, BIG - 1), min_size=1, max_size=6, unique=True),
       seed=st.integers(0, 2**31), dim=st.integers(1, 9),
       init=st.sampled_from([ts.UniformInit(), ts.UniformInit(bound=3.0), ts.NormalInit(0.2, 1.5),
                             ts.ConstantInit(-0.75)]))
def test_lazy_rows_match_the_plain_python_definition(tmp_path_factory, rows, seed, dim, init):
    spec = ts.TableSpec("t", BIG, dim, init=init)
    with _open(tmp_path_factory.mktemp("s"), [spec], seed=seed) as s:
        got = s.read("t", torch.tensor(rows)).numpy()
    want = np.stack([ref.lazy_row(spec, seed, r) for r in rows])
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def _ks_statistic(sample: np.ndarray, cdf) -> float:
    """Kolmogorov-Smirnov distance between a sample and a continuous CDF."""
    x = np.sort(sample)
    n = x.size
    f = cdf(x)
    return float(max((np.arange(1, n + 1) / n - f).max(), (f - np.arange(n) / n).max()))


def _lag_corr(a: np.ndarray) -> float:
    return float(np.corrcoef(a[:-1], a[1:])[0, 1])


def test_lazy_uniform_is_uniform_and_independent(tmp_path):
    """KS against U(-b, b), moments, and no correlation between neighbouring rows or columns."""
    dim, rows = 8, 8000
    with _open(tmp_path / "s", [ts.TableSpec("t", BIG, dim)], dev=0) as s:
        x = s.read("t", torch.arange(rows) * 1_000_003).double().numpy()
    b = 1 / math.sqrt(dim)
    n = x.size
    assert x.min() >= -b and x.max() <= b
    # KS critical value at alpha = 1e-3 is 1.95 / sqrt(n)
    assert _ks_statistic(x.ravel(), lambda v: (v + b) / (2 * b)) < 1.95 / math.sqrt(n)
    assert abs(x.mean()) < 4 * (b / math.sqrt(3)) / math.sqrt(n)
    assert abs(x.var() - b * b / 3) < 0.02 * b * b / 3
    for series in (x[:, 0], x[:, 3], x[0], x.ravel()):  # down rows, along columns
        assert abs(_lag_corr(series if series.size > 100 else x.ravel())) < 4 / math.sqrt(series.size)
    assert abs(float(np.corrcoef(x[:, 0], x[:, 1])[0, 1])) < 4 / math.sqrt(rows)


def test_lazy_normal_is_normal(tmp_path):
    std, mean, dim, rows = 0.3, 0.1, 16, 4000
    spec = ts.TableSpec("t", BIG, dim, init=ts.NormalInit(std, mean))
    with _open(tmp_path / "s", [spec], dev=0) as s:
        x = s.read("t", torch.arange(rows)).double().numpy().ravel()
    z = (x - mean) / std
    cdf = np.vectorize(lambda v: 0.5 * (1 + math.erf(v / math.sqrt(2))))
    assert _ks_statistic(z, cdf) < 1.95 / math.sqrt(z.size)
    assert abs(z.mean()) < 4 / math.sqrt(z.size)
    assert abs(z.std() - 1) < 0.02
    assert abs(float(np.mean(z**3))) < 0.1 and abs(float(np.mean(z**4)) - 3) < 0.2  # skew, kurtosis


# optimizers against torch.optim ------------------------------------------------------------------
TORCH_OPT = {
    "sgd": (lambda lr, wd: ts.SGD(lr, weight_decay=wd),
            lambda p, lr, wd: torch.optim.SGD([p], lr=lr, weight_decay=wd)),
    "adagrad": (lambda lr, wd: ts.Adagrad(lr, eps=1e-10, weight_decay=wd),
                lambda p, lr, wd: torch.optim.Adagrad([p], lr=lr, eps=1e-10, weight_decay=wd)),
    "adam": (lambda lr, wd: ts.Adam(lr, betas=(0.8, 0.95), eps=1e-8, weight_decay=wd),
             lambda p, lr, wd: torch.optim.Adam([p], lr=lr, betas=(0.8, 0.95), eps=1e-8, weight_decay=wd)),
}


def _batches(rows: int, dim: int, steps: int, seed: int):
    """Batches that touch every row (with repeats), so a dense torch.optim step is the same."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.cat([torch.randperm(rows, generator=gen), torch.randint(0, rows, (rows,), generator=gen)])
        yield ids, torch.randn(ids.numel(), dim, generator=gen)


def _torch_reference(kind: str, w0: torch.Tensor, lr: float, wd: float, batches) -> torch.Tensor:
    p = torch.nn.Parameter(w0.clone())
    opt = TORCH_OPT[kind][1](p, lr, wd)
    for ids, grads in batches:
        opt.zero_grad()
        (p[ids] * grads).sum().backward()  # the gradient of row r: the sum of its rows' grads
        opt.step()
    return p.detach()


def _store_run(path, kind_or_opt, lr, wd, rows, dim, batches, fused: bool):
    opt = TORCH_OPT[kind_or_opt][0](lr, wd) if isinstance(kind_or_opt, str) else kind_or_opt
    spec = ts.TableSpec("t", 10**9, dim, optimizer=opt)
    ids_all = torch.arange(rows) * 7919
    with _open(path, [spec], dev=rows // 2, host=rows // 4) as s:  # rows move between tiers
        s.fused = fused
        w0 = s.read("t", ids_all)
        for ids, grads in batches:
            s.apply("t", ids_all[ids], grads)
        return w0, s.read("t", ids_all)


@pytest.mark.parametrize("fused", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("kind", sorted(TORCH_OPT))
def test_optimizers_with_weight_decay_match_torch_optim(tmp_path, kind, fused):
    rows, dim, steps, lr, wd = 24, 5, 15, 0.05, 0.3
    w0, got = _store_run(tmp_path / "s", kind, lr, wd, rows, dim, _batches(rows, dim, steps, 1), fused)
    want = _torch_reference(kind, w0, lr, wd, _batches(rows, dim, steps, 1))
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    # the test can tell weight decay from none: without it the result is far outside the tolerance
    no_wd = _torch_reference(kind, w0, lr, 0.0, _batches(rows, dim, steps, 1))
    assert float((no_wd - want).abs().max()) > 1e-3


@pytest.mark.parametrize("fused", [True, False], ids=["kernels", "torch"])
def test_rowwise_adagrad_matches_a_numpy_reference(tmp_path, fused):
    rows, dim, steps, lr, wd, eps = 20, 6, 12, 0.1, 0.2, 1e-6
    opt = ts.RowWiseAdagrad(lr, eps=eps, weight_decay=wd)
    w0, got = _store_run(tmp_path / "s", opt, lr, wd, rows, dim, _batches(rows, dim, steps, 2), fused)
    p = np.concatenate([w0.double().numpy(), np.zeros((rows, 1))], axis=1)
    for ids, grads in _batches(rows, dim, steps, 2):
        g = np.zeros((rows, dim))
        np.add.at(g, ids.numpy(), grads.double().numpy())
        p = ref.reference_step(opt.to_config(), p, g, dim)
    np.testing.assert_allclose(got.double().numpy(), p[:, :dim], rtol=2e-5, atol=2e-6)


OPTS = [ts.SGD(0.1, weight_decay=0.5), ts.Adagrad(0.2, eps=1e-3, weight_decay=0.25),
        ts.RowWiseAdagrad(0.3, eps=1e-4, weight_decay=0.4), ts.Adam(0.05, (0.7, 0.9), 1e-3, 0.3)]


@pytest.mark.parametrize("opt", OPTS, ids=lambda o: o.kind)
@given(data=st.data())
def test_one_step_on_any_payload_matches_the_definition(opt, data):
    """Optimizer.step (torch path) and the numba kernel from arbitrary state, vs float64 numpy."""
    from tierstore.fused import BatchUpdate

    dim = data.draw(st.integers(1, 11))
    n = data.draw(st.integers(1, 5))
    seed = data.draw(st.integers(0, 2**31))
    gen = torch.Generator().manual_seed(seed)
    pdim = dim + opt.state_dim(dim)
    assert opt.state_dim(dim) == ref.state_dim(opt.kind, dim)
    p0 = torch.randn(n, pdim, generator=gen)
    if opt.kind in ("adagrad", "rowwise_adagrad"):
        p0[:, dim:] = p0[:, dim:].abs()  # accumulators are sums of squares
    if opt.kind == "adam":
        p0[:, 2 * dim : 3 * dim] = p0[:, 2 * dim : 3 * dim].abs()
        p0[:, 3 * dim] = torch.randint(0, 50, (n,), generator=gen).float()
    grads = torch.randn(n, dim, generator=gen) * data.draw(st.sampled_from([1e-3, 1.0, 30.0]))
    want = ref.reference_step(opt.to_config(), p0.double().numpy(), grads.double().numpy(), dim)
    direct = p0.clone()
    opt.step(direct, grads, dim)
    for use_kernel in (True, False):
        p = p0.clone()
        BatchUpdate(opt, dim, n, torch.arange(n), grads, use_kernel=use_kernel).apply(p, torch.arange(n))
        np.testing.assert_allclose(p.double().numpy(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(direct.double().numpy(), want, rtol=1e-5, atol=1e-6)
    # positions -> unique rows, gradient rows shared by bags and scaled per position
    pos = data.draw(st.integers(1, 9))
    inverse = torch.randint(0, n, (pos,), generator=gen)
    bags = data.draw(st.integers(1, 4))
    bag_of = torch.randint(0, bags, (pos,), generator=gen)
    grad_out = torch.randn(bags, dim, generator=gen)
    scale = torch.rand(pos, generator=gen) * 2 - 0.5
    g = np.zeros((n, dim))
    for q in range(pos):
        g[int(inverse[q])] += grad_out[int(bag_of[q])].double().numpy() * float(scale[q])
    touched = np.isin(np.arange(n), inverse.numpy())
    want = ref.reference_step(opt.to_config(), p0.double().numpy(), g, dim)
    want[~touched] = p0.double().numpy()[~touched]  # rows without a position are not updated
    for use_kernel in (True, False):
        p = p0.clone()
        slots = torch.arange(n)
        upd = BatchUpdate(opt, dim, n, inverse, grad_out, bag_of=bag_of, scale=scale, use_kernel=use_kernel)
        upd.apply(p, slots)
        np.testing.assert_allclose(p.double().numpy()[touched], want[touched], rtol=1e-5, atol=1e-5)
        if use_kernel:  # a CUDA table's route (rows through the host, the same kernel): same bits
            q = torch.cat([torch.zeros(3, p0.shape[1]), p0])  # the rows at other slots
            BatchUpdate(opt, dim, n, inverse, grad_out, bag_of=bag_of, scale=scale).apply_on_host(
                q, slots + 3)
            assert torch.equal(q[3:].view(torch.int32), p.view(torch.int32))


@pytest.mark.parametrize("opt", OPTS, ids=lambda o: o.kind)
def test_lazy_update_leaves_untouched_rows_and_counts_steps_per_row(tmp_path, opt):
    """A sparse update: rows outside the batch keep weights and state (no decay, no Adam step)."""
    spec = ts.TableSpec("t", 100, 4, optimizer=opt)
    gen = torch.Generator().manual_seed(5)
    model = ref.DictStore([spec])
    with _open(tmp_path / "s", [spec], dev=2, host=2) as s:
        before = s.read("t", torch.tensor([50, 51]))
        for step in range(6):
            ids = torch.tensor([1, 2, 1]) if step % 2 else torch.tensor([3, 1])
            g = torch.randn(ids.numel(), 4, generator=gen)
            s.apply("t", ids, g)
            model.apply("t", ids, g)
        assert torch.equal(s.read("t", torch.tensor([50, 51])), before)
        assert torch.equal(s.read("t", torch.arange(5)), model.read("t", torch.arange(5)))
    if opt.kind == "adam":  # row 1 took 6 steps, row 2 three, row 3 three, row 0 none
        counts = model.payloads("t", torch.arange(4))[:, 3 * 4]
        assert counts.tolist() == [0.0, 6.0, 3.0, 3.0]


def test_duplicate_ids_sum_their_gradients(tmp_path):
    """apply(ids with repeats) is one step with the summed gradient, not one step per repeat."""
    spec = ts.TableSpec("t", 100, 3, optimizer=ts.Adagrad(0.5))
    g = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 4.0], [2.0, 2.0, 2.0]])
    with _open(tmp_path / "a", [spec]) as a, _open(tmp_path / "b", [spec]) as b:
        a.apply("t", torch.tensor([7, 7, 7]), g)
        b.apply("t", torch.tensor([7]), g.sum(0, keepdim=True))
        w0 = ref.lazy_row(spec, 0, 7).astype(np.float64)
        want = ref.reference_step(spec.optimizer.to_config(),
                                  np.concatenate([w0, np.zeros(3)])[None], g.sum(0).double().numpy()[None], 3)
        np.testing.assert_allclose(a.read("t", torch.tensor([7])).double().numpy(), want[:, :3], rtol=1e-6)
        assert torch.equal(a.read("t", torch.tensor([7])), b.read("t", torch.tensor([7])))


# stochastic rounding ---------------------------------------------------------------------------
def _neighbours(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The 16-bit values just below and above |x| (float64), from the format's definition."""
    mant = 7 if dtype == "bfloat16" else 10
    min_exp = -126 if dtype == "bfloat16" else -14
    a = np.abs(x.astype(np.float64))
    e = np.maximum(np.floor(np.log2(a)), min_exp)
    spacing = np.exp2(e - mant)
    lo = np.floor(a / spacing) * spacing
    return lo, lo + spacing


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_stochastic_rounding_rounds_up_with_probability_equal_to_the_fraction(tmp_path, dtype):
    """Over many values, P(round up) = (|x| - lo) / (hi - lo): a binomial test per fraction band."""
    from tierstore.precision import CODECS

    codec = CODECS[dtype]
    gen = np.random.default_rng(11)
    n = 40_000
    x = (gen.uniform(0.5, 8.0, n) * np.where(gen.random(n) < 0.5, -1, 1)).astype(np.float32)
    lo, hi = _neighbours(x, dtype)
    frac = (np.abs(x) - lo) / (hi - lo)
    keep = (frac > 0) & (frac < 1)
    xt = torch.from_numpy(x[keep]).reshape(-1, 1)
    old = codec.encode(torch.zeros_like(xt))
    r = codec.decode(codec.encode_stochastic(xt, old), 1).double().numpy().ravel()
    up = np.abs(r) == hi[keep]
    assert np.all(up | (np.abs(r) == lo[keep]))  # always one of the two neighbours
    f = frac[keep]
    for a, b in [(0, 0.1), (0.1, 0.3), (0.3, 0.5), (0.5, 0.7), (0.7, 0.9), (0.9, 1)]:
        band = (f > a) & (f <= b)
        p = f[band]
        sigma = math.sqrt(float((p * (1 - p)).sum()))
        assert abs(float(up[band].sum()) - float(p.sum())) < 4.5 * sigma, (a, b)
    # the rounding error averages out: the mean error is within noise, far below half a spacing
    err = r - x[keep].astype(np.float64)
    spacing = hi[keep] - lo[keep]
    assert abs(float((err / spacing).mean())) < 4.5 * 0.5 / math.sqrt(err.size)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_sgd_training_is_unbiased_where_round_to_nearest_stalls(tmp_path, dtype):
    """Many SGD steps each under half a 16-bit spacing: the weights follow the exact float64 sums."""
    rows, steps = 300, 40
    spec = ts.TableSpec("t", 1000, 2, optimizer=ts.SGD(1.0), init=ts.ConstantInit(1.0), dtype=dtype)
    spacing = 2.0**-8 if dtype == "bfloat16" else 2.0**-11  # just below 1.0
    gen = torch.Generator().manual_seed(8)
    total = torch.zeros(rows, 2, dtype=torch.float64)
    with _open(tmp_path / "s", [spec], dev=rows) as s:
        ids = torch.arange(rows)
        for _ in range(steps):  # steps of 0.125 to 0.375 spacings: round-to-nearest keeps 1.0
            g = (0.125 + 0.25 * torch.rand(rows, 2, generator=gen)) * spacing
            s.apply("t", ids, g)
            total += g.double()
        w = s.read("t", ids).double()
    err = w - (1.0 - total)
    assert float(total.mean()) > 9 * spacing  # the drift round-to-nearest would lose
    walk = 0.5 * math.sqrt(steps) * spacing  # the bound on one value's walk's sigma
    assert abs(float(err.mean())) < 4.5 * walk / math.sqrt(err.numel())  # ~0.6 spacing: no drift
    assert float(err.abs().max()) < 5 * walk  # 5 sigma of the walk


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_half_sgd_constant_gradient_is_not_lost(tmp_path, dtype):
    """A constant sub-spacing gradient must still move the weights on average."""
    rows, steps = 50, 40
    spec = ts.TableSpec("t", 1000, 2, optimizer=ts.SGD(1.0), init=ts.ConstantInit(1.0), dtype=dtype)
    delta = 2.0**-10  # a quarter of the bfloat16 spacing just below 1.0
    with _open(tmp_path / "s", [spec], dev=rows) as s:
        for _ in range(steps):
            s.apply("t", torch.arange(rows), torch.full((rows, 2), delta))
        w = s.read("t", torch.arange(rows)).double()
    assert float((w - (1.0 - steps * delta)).abs().mean()) < 2.0**-8


def test_bfloat16_rows_follow_the_documented_rounding_bits_bit_for_bit(tmp_path):
    """SGD(lr=1) on a bfloat16 table, through LMDB and a reopen: every stored bit pattern is the
    independent model's (float32 step, then `ref.sr_bfloat16` at the table's update count)."""
    dim, steps = 3, 24
    spec = ts.TableSpec("t", 10**7, dim, optimizer=ts.SGD(1.0), init=ts.ConstantInit(1.0),
                        dtype="bfloat16")
    ids = torch.tensor([5, 17, 10**6 + 3, 9_999_999])
    model = np.ones((len(ids), dim), np.float32)
    gen = torch.Generator().manual_seed(21)
    s = _open(tmp_path / "s", [spec], dev=1, host=1)
    try:
        for k in range(1, steps + 1):
            if k == steps // 2:  # the update count survives a close and reopen
                s.close()
                s = _open(tmp_path / "s", [spec], dev=1, host=1)
            g = (torch.rand(len(ids), dim, generator=gen) * 2.0**-9).float()
            s.apply("t", ids, g)
            x = model - g.numpy()  # one float32 rounding, as the kernel's w - lr * g with lr = 1
            for i, row in enumerate(ids.tolist()):
                for c in range(dim):
                    b = ref.sr_bfloat16(float(x[i, c]), row, c, k)
                    model[i, c] = np.array([b << 16], np.uint32).view(np.float32)[0]
        got = s.read("t", ids).numpy()
    finally:
        s.close()
    assert np.array_equal(got.view(np.uint32), model.view(np.uint32))
    assert float(model.mean()) < 1.0 - 2.0**-8  # the weights moved (a stalled rounding would not)


# cache simulators -------------------------------------------------------------------------------
@given(keys=st.lists(st.integers(0, 15), max_size=80), cap=st.integers(0, 10))
def test_exact_simulators_match_the_plain_python_policies(keys, cap):
    from tierstore.sim.exact import dense_keys, simulate

    ids, n = dense_keys(np.array(keys, dtype=np.int64))
    for policy, model in (("lru", ref.py_lru), ("fifo", ref.py_fifo), ("lfu", ref.py_lfu),
                          ("belady", ref.py_belady), ("clock", ref.py_clock), ("sieve", ref.py_sieve)):
        assert simulate(policy, ids, n, cap) == model(keys, cap), policy


# optimizer and initializer configuration ----------------------------------------------------------
@pytest.mark.parametrize(("cls", "bad"), [
    (ts.SGD, {"lr": float("nan")}), (ts.SGD, {"lr": -0.1}), (ts.SGD, {"lr": "0.1"}),
    (ts.SGD, {"weight_decay": float("inf")}), (ts.Adagrad, {"eps": -1e-8}),
    (ts.Adagrad, {"lr": None}), (ts.RowWiseAdagrad, {"eps": float("-inf")}),
    (ts.Adam, {"betas": (0.9, float("nan"))}), (ts.Adam, {"betas": (0.9, "x")}),
    (ts.Adam, {"eps": -1.0}), (ts.Adam, {"lr": -1e-3}),
])
def test_bad_optimizer_hyperparameters_are_config_errors(cls, bad):
    (name, value), = bad.items()
    vals = value if isinstance(value, tuple) else (value,)
    not_finite = any(not isinstance(v, (int, float)) or not math.isfinite(v) for v in vals)
    msg = (f"^{cls.__name__}.{name} must be a finite number" if not_finite
           else f"^{cls.__name__}: lr and eps must be >= 0$")
    with pytest.raises(ts.ConfigError, match=msg):
        cls(**bad)


@pytest.mark.parametrize("opt", [ts.SGD(0.0), ts.SGD(1, weight_decay=0), ts.Adagrad(0.0, eps=0.0),
                                 ts.RowWiseAdagrad(2, eps=0), ts.Adam(0.0, (0.0, 0.0), 0.0, 0.0)],
                         ids=lambda o: o.kind)
def test_zero_and_integer_hyperparameters_are_accepted_and_round_trip(opt):
    from tierstore.optimizers import optimizer_from_config

    cfg = opt.to_config()
    assert cfg["kind"] == opt.kind
    back = optimizer_from_config(json_roundtrip(cfg))
    assert back == opt and type(back) is type(opt)


def json_roundtrip(cfg: dict) -> dict:
    import json

    return json.loads(json.dumps(cfg))


def test_unknown_optimizer_kind_is_a_config_error():
    from tierstore.optimizers import optimizer_from_config

    with pytest.raises(ts.ConfigError, match="unknown optimizer"):
        optimizer_from_config({"kind": "lamb", "lr": 0.1})


@pytest.mark.parametrize("init", [ts.UniformInit(), ts.UniformInit(bound=0.5), ts.NormalInit(0.2, -1.0),
                                  ts.ConstantInit(), ts.ConstantInit(3.5)], ids=lambda i: i.kind)
def test_initializers_round_trip_through_their_config(init):
    from tierstore.initializers import initializer_from_config

    cfg = json_roundtrip(init.to_config())
    assert cfg["kind"] == init.kind
    assert initializer_from_config(cfg) == init


def test_optimizer_defaults_are_torch_optims():
    """Defaults as documented: torch.optim's for SGD's lr, Adagrad and Adam; row-wise as Adagrad."""
    p = [torch.nn.Parameter(torch.zeros(1))]
    ada, adam = torch.optim.Adagrad(p).defaults, torch.optim.Adam(p).defaults
    assert (ts.Adagrad().lr, ts.Adagrad().eps, ts.Adagrad().weight_decay) == (ada["lr"], ada["eps"], 0.0)
    assert (ts.RowWiseAdagrad().lr, ts.RowWiseAdagrad().eps, ts.RowWiseAdagrad().weight_decay) == \
        (ada["lr"], ada["eps"], 0.0)
    assert (ts.Adam().lr, ts.Adam().betas, ts.Adam().eps, ts.Adam().weight_decay) == \
        (adam["lr"], adam["betas"], adam["eps"], 0.0)
    assert (ts.SGD().lr, ts.SGD().weight_decay) == (0.01, 0.0)


def test_every_optimizer_has_a_fused_kernel():
    from tierstore.engine.plan import KINDS
    from tierstore.fused import KERNELS
    from tierstore.optimizers import OPTIMIZERS

    assert set(KERNELS) == set(OPTIMIZERS)
    assert KERNELS == KINDS  # the engine's plan codes the optimizers as the per-table path does


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_pooling_with_one_weighted_position_and_empty_bags(tmp_path, mode):
    """Bags of 0 and 1 positions, per-sample weights on a single position, against EmbeddingBag."""
    spec = ts.TableSpec("t", 50, 3)
    with _open(tmp_path / "s", [spec], dev=8, host=8) as s:
        table = torch.nn.EmbeddingBag(50, 3, mode=mode)
        with torch.no_grad():
            table.weight.copy_(s.read("t", torch.arange(50)))
        bag = ts.TieredEmbeddingBag(s, "t", mode=mode)
        for ids, offsets in ((torch.tensor([7]), torch.tensor([0])),
                             (torch.tensor([4, 9]), torch.tensor([0, 0, 2]))):
            torch.testing.assert_close(bag(ids, offsets), table(ids, offsets), rtol=0, atol=0)
        if mode == "sum":
            w = torch.tensor([2.5])
            torch.testing.assert_close(bag(torch.tensor([7]), torch.tensor([0]), per_sample_weights=w),
                                       table(torch.tensor([7]), torch.tensor([0]), per_sample_weights=w))


@pytest.mark.parametrize("policy", ["lru", "fifo", "clock", "lfu", "sieve", "belady"])
def test_tier_policies_agree_with_the_exact_simulators_one_request_at_a_time(policy):
    """The tier's policy objects, driven one request per batch, miss exactly as the simulators."""
    from tierstore.sim.exact import dense_keys, simulate
    from tierstore.sim.tier import simulate_tier
    from tierstore.traces import load_trace

    ids, _ = load_trace("zipf:alpha=0.9,keys=300,requests=1500,seed=5").dense()
    ids = dense_keys(ids)[0]
    n = int(ids.max()) + 1
    for cap in (7, 60):
        assert simulate_tier(ids, n, policy, cap, 1) == simulate(policy, ids, n, cap), cap


def test_lazy_rows_of_default_initializers_are_the_documented_ones(tmp_path):
    """NormalInit() is N(0, 0.01), ConstantInit() is zeros, UniformInit() bounds by 1/sqrt(dim)."""
    assert (ts.NormalInit().std, ts.NormalInit().mean) == (0.01, 0.0)
    assert ts.ConstantInit().value == 0.0 and ts.UniformInit().bound is None
    specs = [ts.TableSpec("n", 100, 4, init=ts.NormalInit()), ts.TableSpec("c", 100, 4, init="constant")]
    with _open(tmp_path / "s", specs) as s:
        want = np.array([ref.lazy_normal(0, "n", 3, c, 0.01) for c in range(4)], dtype=np.float32)
        assert np.array_equal(s.read("n", torch.tensor([3]))[0].numpy(), want)
        assert torch.equal(s.read("c", torch.tensor([3])), torch.zeros(1, 4))
