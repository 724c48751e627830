"""The distributed trainer: Criteo TSV shares, checkpoints, and resume after a kill -9 of a rank."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import tierstore as ts
from tierstore.distributed import ShardedTierStore
from tierstore.distributed.errors import DistributedError
from tierstore.distributed.launch import run_local


def _cfg(root, steps, resume=False, data="synthetic"):
    from integration.train import TrainConfig

    return TrainConfig(run_dir=root, tables="uniform:500", dim=4, steps=steps, batch=32,
                       eval_batches=2, prefetch=1, progress=False, device_capacity="40",
                       host_capacity="40", bottom="8", top="8", checkpoint_interval=2,
                       resume=resume, data=data)


def _kill_rank1_at_3(rank, step):
    if rank == 1 and step == 3:
        os.kill(os.getpid(), signal.SIGKILL)


def _train(rank, world, root, steps, resume, data, kill):
    from integration.distributed import run_distributed

    return run_distributed(_cfg(root, steps, resume, data), sharding="auto", timeout_s=15,
                           on_step=_kill_rank1_at_3 if kill else None)


def _final_state(rank, world, root):
    """The final checkpoint's rows of every table and the dense state (read back on every rank)."""
    from integration.data import SPARSE_NAMES

    ckpt = f"{root}/ckpt/step-000000006"
    store = ShardedTierStore.restore(f"{ckpt}/store", f"{root}/readback", timeout=15)
    rows = {t: store.read(t, torch.arange(500)) for t in SPARSE_NAMES[:4]}
    store.close()
    dense = torch.load(f"{ckpt}/dense.pt", weights_only=True)
    return rows, dense


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("data", ["synthetic", pytest.param("tsv", marks=pytest.mark.slow)])
def test_resume_after_kill_is_bit_identical(tmp_path, data):
    if data == "tsv":  # a small Criteo-format file: label, 13 integers, 26 hashed categories
        g = torch.Generator().manual_seed(1)
        lines = []
        for _ in range(32 * 10):
            label = int(torch.randint(0, 2, (1,), generator=g))
            ints = torch.randint(0, 50, (13,), generator=g).tolist()
            cats = [f"{int(x):08x}" for x in torch.randint(0, 40, (26,), generator=g)]
            lines.append("\t".join([str(label), *map(str, ints), *cats]))
        src = tmp_path / "day_0"
        src.write_text("\n".join(lines) + "\n")
        data = str(src)
    pre = ["integration.distributed", __name__]
    whole = run_local(2, _train, str(tmp_path / "a"), 6, False, data, False, timeout_s=240,
                      preload=pre)
    assert whole[0]["steps"] == 6 and 0 <= whole[0]["final_auc"] <= 1
    with pytest.raises(DistributedError) as info:  # rank 1 is killed after step 3
        run_local(2, _train, str(tmp_path / "b"), 6, False, data, True, timeout_s=240,
                  preload=pre)
    assert "died with exit code -9" in str(info.value)
    assert (tmp_path / "b" / "ckpt" / "LATEST").read_text() == "step-000000002"
    resumed = run_local(2, _train, str(tmp_path / "b"), 6, True, data, False, timeout_s=240,
                        preload=pre)
    assert resumed[0]["start_step"] == 2 and resumed[0]["steps"] == 6
    a = run_local(2, _final_state, str(tmp_path / "a"), timeout_s=120, preload=pre)
    b = run_local(2, _final_state, str(tmp_path / "b"), timeout_s=120, preload=pre)
    for r in range(2):
        assert _same(a[r][0], b[r][0]), "embedding rows differ"
        assert _same(a[r][1], b[r][1]), "dense model or optimizer differ"
    assert resumed[0]["final_auc"] == whole[0]["final_auc"]


def test_distributed_training_takes_the_cpu_device_only(tmp_path):
    """The dense model trains on the CPU over gloo, so each rank's shard is on cfg.device (the
    CPU), not the default device (CUDA where there is one, where the pooled rows met a CPU
    model); --device cuda is refused before any process group or store is made."""
    from dataclasses import replace

    from integration.distributed import run_distributed

    with pytest.raises(ts.ConfigError, match="--device cpu"):
        run_distributed(replace(_cfg(str(tmp_path / "r"), 2), device="cuda"))
    assert not (tmp_path / "r" / "store").exists()
