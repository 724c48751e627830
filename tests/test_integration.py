"""The training integration: data, DLRM, trainer, AUC, checkpoints and resume-after-kill."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from integration import train as tr
from integration.data import (
    CRITEO_1E11,
    NUM_SPARSE,
    CriteoTSV,
    SyntheticCriteo,
    hash_categorical,
    parse_tables,
)
from tests.profiles import needs
from tierstore.backends.lmdb_backend import LmdbBackend
from tierstore.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CRITEO_CSV = ROOT / "../shared/data/criteo/criteo_sample_deepctr.csv"
needs_criteo = needs(CRITEO_CSV.is_file(), "Criteo sample not present")

TINY = ["--tables", "uniform:1000000000", "--dim", "8", "--batch", "64", "--hot", "3000",
        "--device-capacity", "2000", "--host-capacity", "6000", "--bottom", "16", "--top", "16",
        "--eval-batches", "2", "--no-progress", "--threads", "1"]


def test_auc_matches_pairwise_count():
    rng = np.random.default_rng(0)
    scores = np.round(rng.normal(size=300), 1)  # many ties
    labels = rng.random(300) < 0.3
    pos, neg = scores[labels], scores[~labels]
    want = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (
        len(pos) * len(neg))
    got = tr.auc(torch.from_numpy(scores), torch.from_numpy(labels.astype(np.float32)))
    assert got == pytest.approx(want, abs=1e-12)
    assert np.isnan(tr.auc(torch.ones(4), torch.ones(4)))


def test_synthetic_is_a_pure_function_of_step():
    gen = SyntheticCriteo(CRITEO_1E11, seed=3)
    a, b, c = gen.batch(5, 512), gen.batch(5, 512), gen.batch(6, 512)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.ids, c.ids)
    assert a.ids.shape == (NUM_SPARSE, 512) and a.dense.shape == (512, 13)
    cards = torch.tensor(CRITEO_1E11).unsqueeze(1)
    assert bool((a.ids >= 0).all()) and bool((a.ids < cards).all())
    assert sum(CRITEO_1E11) >= 10**11 and max(CRITEO_1E11) <= 10**11
    assert 0.1 < float(a.labels.mean()) < 0.5
    held_out = gen.batch(5, 512, stream=1)
    assert not torch.equal(held_out.ids, a.ids)
    # the ids of huge tables are spread over the whole range, and skewed
    big = a.ids[2]
    assert int(big.max()) > 10**10 and torch.unique(big).numel() < 400


def test_rank_to_id_is_one_to_one():
    gen = SyntheticCriteo((50,) * NUM_SPARSE, hot=50)
    ids = torch.cat([gen.batch(s, 4096).ids for s in range(3)], dim=1)
    assert all(torch.unique(ids[f]).numel() == 50 for f in range(NUM_SPARSE))


def test_bad_options_raise_config_errors(tmp_path):
    with pytest.raises(ConfigError):
        parse_tables("uniform:x")
    with pytest.raises(ConfigError):
        parse_tables("1,2,3")
    with pytest.raises(ConfigError):
        SyntheticCriteo((10,) * 3)
    with pytest.raises(ConfigError):
        SyntheticCriteo(CRITEO_1E11, alpha=0.5)
    with pytest.raises(ConfigError):
        tr.TrainConfig(batch=0).validate()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "x").write_text("mine")
    with pytest.raises(ConfigError):
        tr.Trainer(tr.TrainConfig(run_dir=str(tmp_path / "foreign"), tables="uniform:100"))
    with pytest.raises(ConfigError):
        tr.Trainer(tr.TrainConfig(run_dir=str(tmp_path / "none"), tables="uniform:100", resume=True))
    with pytest.raises(ConfigError, match="prefetch"):
        tr.TrainConfig(prefetch=-1).validate()


def test_hash_categorical_is_stable_and_in_range():
    col = np.array(["05db9164", "", "68fd1e64", "05db9164", "FFFFFFFF"])
    ids = hash_categorical(col, 0, 1000)
    assert ids[0] == ids[3] and bool(((ids >= 0) & (ids < 1000)).all())
    assert hash_categorical(col, 1, 10**11)[0] != hash_categorical(col, 2, 10**11)[0]


@needs_criteo
def test_criteo_reader_csv_tsv_and_gzip_agree(tmp_path):
    cards = parse_tables("kaggle")
    csv = CriteoTSV(CRITEO_CSV, cards)
    a = list(csv.batches(50))
    assert len(a) == 4  # 200 rows
    lines = CRITEO_CSV.read_text().splitlines()[1:]
    tsv_path = tmp_path / "day_0"
    tsv_path.write_text("".join(line.replace(",", "\t") + "\n" for line in lines))
    gz_path = tmp_path / "train.txt.gz"
    with gzip.open(gz_path, "wt") as f:
        f.write(tsv_path.read_text())
    for path in (tsv_path, gz_path):
        b = list(CriteoTSV(path, cards).batches(50, skip=1))
        assert len(b) == 3
        for x, y in zip(a[1:], b, strict=True):
            assert torch.equal(x.ids, y.ids) and torch.equal(x.dense, y.dense)
            assert torch.equal(x.labels, y.labels)
    first = a[0]
    assert set(first.labels.tolist()) <= {0.0, 1.0}
    assert bool(torch.isfinite(first.dense).all()) and bool((first.dense >= 0).all())
    assert bool((first.ids < torch.tensor(cards).unsqueeze(1)).all())


@needs_criteo
def test_train_on_criteo_sample_and_resume_across_epochs(tmp_path):
    # 200 rows / 40 = 5 batches: 2 held out, 3 per training epoch; 7 steps cross two epoch ends
    opts = [*TINY, "--data", str(CRITEO_CSV), "--tables", "kaggle", "--batch", "40", "--steps", "7"]
    assert tr.main([*opts, "--run-dir", str(tmp_path / "full")]) == 0
    part = tmp_path / "part"
    assert tr.main([*opts[:-1], "4", "--checkpoint-interval", "4", "--run-dir", str(part)]) == 0
    assert tr.main([*opts, "--resume", "--run-dir", str(part)]) == 0
    a = torch.load(tmp_path / "full" / "final_dense.pt", weights_only=True)
    b = torch.load(part / "final_dense.pt", weights_only=True)
    assert all(torch.equal(v, b["model"][k]) for k, v in a["model"].items() if torch.is_tensor(v))
    extra = [k for k, v in a["model"].items() if not torch.is_tensor(v)]  # the stores' pointers
    assert extra and all(a["model"][k]["clock"] == b["model"][k]["clock"] == 7 for k in extra)


def test_tiny_training_beats_chance(tmp_path, capsys):
    cfg = tr.TrainConfig(run_dir=str(tmp_path / "run"), tables="uniform:100000000000", dim=8,
                         batch=256, steps=40, hot=1000, bottom="16", top="32", eval_batches=4,
                         eval_interval=20, device_capacity="8000", host_capacity="16000",
                         progress=False, lr=0.1, dense_lr=0.01)
    t = tr.Trainer(cfg)
    try:
        s = t.run()
    finally:
        t.close()
    assert s["final_auc"] > 0.62, s["evals"]
    assert s["tiers"]["device"]["lookups"] > 0 and s["rows_stored"] > 0
    assert s["total_rows"] == 26 * 10**11
    text = tr.format_summary(s)
    assert "held-out AUC" in text and "hit rate" in text


def _dump(store_dir: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    backend = LmdbBackend(store_dir, readonly=True)
    txn = backend.snapshot()
    try:
        out = {}
        for name in [f"C{i}" for i in range(1, 27)]:
            parts = list(backend.iter_rows(name, 10, txn))  # 8 + 1 state + 1 stamp
            out[name] = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
        return out
    finally:
        txn.abort()
        backend.close()


def _cli(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "integration.train", *TINY, "--run-dir", str(run_dir), *extra]


def test_resume_after_kill_is_bit_identical(tmp_path, capsys):
    env = dict(os.environ)
    steps = ["--steps", "12", "--checkpoint-interval", "4"]
    full = tmp_path / "full"
    assert tr.main([*TINY, "--run-dir", str(full), *steps]) == 0
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cli(killed, *steps), env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("checkpoint step 4:"):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "final_dense.pt").exists()
    capsys.readouterr()
    other = ["--device-capacity", "500"] + (["--prefetch", "2"] if tr.Prefetcher is not None else [])
    assert tr.main([*TINY, "--run-dir", str(killed), *steps, "--resume", *other]) == 0
    out = capsys.readouterr().out
    assert "steps 4 -> 12" in out
    a = torch.load(full / "final_dense.pt", weights_only=True)
    b = torch.load(killed / "final_dense.pt", weights_only=True)
    assert a["step"] == b["step"] == 12
    for k, v in a["model"].items():
        if torch.is_tensor(v):
            assert torch.equal(v, b["model"][k]), k
        else:  # a tiered module's pointer to its store: the same clock and tables
            assert (v["clock"], v["tables"]) == (b["model"][k]["clock"], b["model"][k]["tables"]), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    da, db = _dump(full / "store"), _dump(killed / "store")
    for name in da:
        assert np.array_equal(da[name][0], db[name][0]), name
        assert np.array_equal(da[name][1].view(np.uint32), db[name][1].view(np.uint32)), name


def test_resume_rejects_changed_model_options(tmp_path):
    run = tmp_path / "run"
    assert tr.main([*TINY, "--steps", "2", "--run-dir", str(run)]) == 0
    with pytest.raises(SystemExit):
        tr.main([*TINY, "--steps", "4", "--run-dir", str(run), "--resume", "--dim", "4"])


def test_a_run_directory_in_use_is_refused(tmp_path, capsys):
    small = ["--device-capacity", "64", "--host-capacity", "64"]  # the defaults cost 2 GiB of slots here
    cfg = tr.TrainConfig(run_dir=str(tmp_path / "run"), tables="uniform:1000", progress=False,
                         device_capacity="64", host_capacity="64")
    t = tr.Trainer(cfg)
    try:
        assert tr.main(["--tables", "uniform:1000", "--run-dir", cfg.run_dir, "--no-progress", *small]) == 1
        assert "in use" in capsys.readouterr().err
        assert (tmp_path / "run" / "run.json").is_file()
    finally:
        t.close()
    assert tr.main(["--tables", "uniform:1000", "--run-dir", cfg.run_dir, "--no-progress",
                    "--steps", "1", "--batch", "8", "--eval-batches", "1", *small]) == 0


def test_demo_exits_non_zero_below_the_readme_auc_bar(tmp_path, monkeypatch, capsys):
    """--demo fails (exit 3) when the held-out AUC misses the README's 0.70; a short run does."""
    short = ["--demo", "--steps", "2", "--batch", "64", "--eval-batches", "1", "--eval-interval", "2",
             "--checkpoint-interval", "0", "--prefetch", "0", "--device-capacity", "2000",
             "--host-capacity", "2000", "--no-progress", "--threads", "1"]
    assert tr.DEMO_MIN_AUC == 0.70
    assert tr.main([*short, "--run-dir", str(tmp_path / "a")]) == 3
    assert "below the demo's bar" in capsys.readouterr().err
    monkeypatch.setattr(tr, "DEMO_MIN_AUC", 0.0)  # the same run passes a bar it reaches
    assert tr.main([*short, "--run-dir", str(tmp_path / "b")]) == 0
