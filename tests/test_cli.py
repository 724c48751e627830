"""The `tierstore` command: every subcommand's --help and a real run, option forwarding, messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

import tierstore as ts
from tierstore.cli import main
from tierstore.sim import bench
from tierstore.stats import progress_line, tier_table
from tierstore.traces import load_trace

REPO = Path(__file__).resolve().parents[1]
TRACE = "zipf:alpha=1.0,keys=500,requests=20000,seed=3"


def _py_lru_misses(keys, cap):
    """LRU misses in plain Python (an independent reference)."""
    od: OrderedDict = OrderedDict()
    misses = 0
    for k in keys:
        if k in od:
            od.move_to_end(k)
            continue
        misses += 1
        if len(od) >= cap:
            od.popitem(last=False)
        od[k] = None
    return misses


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal width


def test_top_level_help_lists_every_command(capsys):
    out = _help(["--help"], capsys)
    for cmd in ("info", "bench-policies", "demo", "export", "import", "checkpoint-verify", "compact"):
        assert cmd in out


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_bench_policies_help_shows_options_defaults_and_trace_formats(capsys, flag):
    out = _help(["bench-policies", flag], capsys)
    assert out.startswith("usage: tierstore bench-policies")
    for opt in ("--trace", "--policy", "--capacity", "--mode", "--batch-size", "--json", "--plot",
                "--row-bytes", "--dim", "--dtype", "--optimizer"):
        assert opt in out
    assert "(default: 0.1%,1%,10%)" in out and "(default: 4096)" in out
    for fmt in ("zipf:", "shift:", ".npy", ".tsrec", "oracleGeneral", "criteo:", ".jsonl", ".gz"):
        assert fmt in out


def test_demo_help_shows_options_and_defaults(capsys):
    out = _help(["demo", "--help"], capsys)
    assert out.startswith("usage: tierstore demo")
    assert "--steps" in out and "(default: 200)" in out and "--host-capacity" in out


@pytest.mark.parametrize("cmd", ["info", "export", "import", "checkpoint-verify", "compact"])
def test_other_commands_help(capsys, cmd):
    out = _help([cmd, "--help"], capsys)
    assert out.startswith(f"usage: tierstore {cmd}")


@pytest.mark.parametrize("sep", [[], ["--"]])
def test_bench_policies_real_run_forwards_options(tmp_path, capsys, sep):
    out = tmp_path / "r.json"
    rc = main(["bench-policies", *sep, "--trace", TRACE, "--policy", "lru", "--capacity", "50",
               "--mode", "exact", "--json", str(out), "--no-progress", "--dim", "16",
               "--optimizer", "rowwise_adagrad"])
    assert rc == 0
    recs = json.loads(out.read_text())
    keys = load_trace(TRACE).rows.tolist()
    run = [r for r in recs if r["mode"] == "exact"]
    assert len(run) == 1 and run[0]["policy"] == "lru" and run[0]["capacity"] == 50
    assert run[0]["misses"] == _py_lru_misses(keys, 50)
    row = (16 + 1) * 4  # 16 float32 weights + one row-wise Adagrad accumulator
    assert run[0]["capacity_bytes"] == 50 * row
    sizing = [r for r in recs if r["mode"] == "sizing"]
    assert len(sizing) == 1 and sizing[0]["row_bytes"] == row
    need = sizing[0]["capacity"]
    assert sizing[0]["capacity_bytes"] == need * row
    # the answer is right: that capacity reaches the target, 1% less does not
    allowed = (1 - 0.9) * len(keys)
    assert _py_lru_misses(keys, need) <= allowed
    assert _py_lru_misses(keys, int(need * 0.99) - 1) > allowed
    text = capsys.readouterr().out
    assert f"{need} rows" in text and "B/row" in text


def test_bench_policies_errors_name_flags(capsys):
    assert main(["bench-policies", "--policy", "nope", "--no-progress"]) == 2
    assert main(["bench-policies", "--row-bytes", "0", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "tierstore bench-policies: error" in err and "--row-bytes" in err
    with pytest.raises(SystemExit) as exc:
        main(["bench-policies", "--no-such-flag"])
    assert exc.value.code == 2


def test_tier_mode_warns_up_front_when_it_will_be_slow(tmp_path, capsys, monkeypatch):
    assert bench.tier_warning(10**6, 4096, 3) is None
    msg = bench.tier_warning(1_200_000, 1, 9)  # the run: 3 policies x 3 sizes
    assert msg and "--mode exact" in msg and "min" in msg
    monkeypatch.setattr(bench, "TIER_RATE", 10)  # make this tiny run "slow"
    rc = main(["bench-policies", "--trace", TRACE, "--policy", "lru", "--capacity", "50",
               "--mode", "tier", "--batch-size", "1", "--limit", "700", "--no-sizing", "--no-progress"])
    assert rc == 0
    cap = capsys.readouterr()
    assert "warning: tier mode" in cap.err and "--mode exact" in cap.err


def test_plot_has_distinct_markers_and_the_compulsory_floor():
    recs = [{"policy": p, "mode": "exact", "capacity": c, "miss_ratio": 0.5 / c}
            for p in ("lfu", "sieve", "lru") for c in (1, 10, 100)]
    fig = bench.plot_figure(recs, "t", floor=0.125)
    ax = fig.axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    markers = [lines[f"{p} (exact)"].get_marker() for p in ("lfu", "sieve", "lru")]
    assert len(set(markers)) == 3
    floor = [ln for label, ln in lines.items() if label.startswith("compulsory")]
    assert len(floor) == 1 and set(floor[0].get_ydata()) == {0.125}


def test_demo_real_run_reports_rows_not_an_ssd_hit_rate(tmp_path, capsys):
    rc = main(["demo", "--steps", "3", "--batch", "512", "--rows", "1000000", "--path",
               str(tmp_path / "d"), "--device-capacity", "256", "--host-capacity", "1024",
               "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "3 steps x 512 ids" in out
    ssd = [ln for ln in out.splitlines() if ln.startswith("ssd")]
    assert len(ssd) == 1 and "rows read" in ssd[0] and "written" in ssd[0]
    assert "hit rate" not in ssd[0]
    with ts.TierStore.open(tmp_path / "d", device="cpu", device_capacity=16, host_capacity=16) as s:
        assert s.table_specs["items"].num_rows == 1_000_000


def test_progress_line_and_table_show_the_same_figures(tmp_path):
    spec = ts.TableSpec("t", 10**9, 4)
    # a small write-behind ring (it grows to one call's moves, 64 rows): rows evicted a few calls
    # ago are read back from LMDB, not from the ring
    with ts.TierStore(tmp_path / "s", [spec], device_capacity=8, host_capacity=16, device="cpu",
                      write_buffer=1) as s:
        rng = np.random.default_rng(0)
        for _ in range(20):
            g = s.gather("t", torch.from_numpy(rng.integers(0, 400, 64)))
            s.apply_unique("t", g.unique, torch.ones(g.unique.numel(), 4))
        st = s.stats()
    assert "hit_rate" not in st["ssd"]
    assert st["ssd"]["rows_read"] == st["ssd"]["hits"] > 0
    assert st["ssd"]["rows_written"] == st["ssd"]["writebacks"] > 0
    assert st["ssd"]["rows_initialized"] == st["ssd"]["misses"]
    line = progress_line(st)
    table = tier_table(st)
    dev, host = st["device"]["hit_rate"], st["host"]["hit_rate"]
    assert f"hit dev {dev:.3f} host {host:.3f}" in line
    assert f" {dev:.3f} " in table[1] and f" {host:.3f} " in table[2]
    assert f"rows read {st['ssd']['rows_read']:,}" in table[3]
    # the definition: host lookups are exactly the device tier's misses
    assert st["host"]["lookups"] == st["device"]["lookups"] - st["device"]["hits"]


def _store(path):
    with ts.TierStore(path, [ts.TableSpec("t", 100, 4)], device_capacity=4, host_capacity=8,
                      device="cpu") as s:
        s.apply("t", torch.arange(10), torch.ones(10, 4))


def test_export_and_import_messages_name_cli_flags(tmp_path, capsys):
    _store(tmp_path / "s")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["export", str(tmp_path / "s"), str(tmp_path / "full")]) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err
    assert main(["export", str(tmp_path / "s"), str(tmp_path / "e")]) == 0
    assert main(["import", str(tmp_path / "e"), str(tmp_path / "full")]) == 2
    err = capsys.readouterr().err
    assert "tierstore import: error" in err and "overwrite" not in err
    assert (tmp_path / "full" / "x").read_text() == "x"


def test_compact_on_an_open_store_says_compacting(tmp_path, capsys):
    _store(tmp_path / "s")
    with ts.TierStore.open(tmp_path / "s", device="cpu", device_capacity=4, host_capacity=4):
        assert main(["compact", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "before compacting" in err and "restoring" not in err
    assert main(["compact", str(tmp_path / "s")]) == 0


def test_console_command_from_outside_the_clone(tmp_path):
    """The module entry point runs from another directory (the wheel check does the installed one)."""
    env = dict(os.environ)
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "tierstore.cli", "bench-policies", "--trace",
                        "zipf:alpha=1.0,keys=100,requests=1000,seed=1", "--policy", "lru",
                        "--capacity", "10", "--mode", "exact", "--json", str(out), "--no-progress"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    recs = json.loads(out.read_text())
    assert recs[0]["policy"] == "lru" and recs[0]["requests"] == 1000


def test_export_import_verify_info_real_runs(tmp_path, capsys):
    _store(tmp_path / "s")
    with ts.TierStore.open(tmp_path / "s", device="cpu", device_capacity=4, host_capacity=4) as s:
        want = s.read("t", torch.arange(100))
        s.checkpoint(tmp_path / "ck")
    assert main(["checkpoint-verify", str(tmp_path / "ck")]) == 0
    assert main(["export", str(tmp_path / "s"), str(tmp_path / "e"), "--level", "3"]) == 0
    assert main(["import", str(tmp_path / "e"), str(tmp_path / "b")]) == 0
    assert main(["info", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "ok: step" in out and "exported 10 rows" in out and "imported 10 rows" in out
    with ts.TierStore.open(tmp_path / "b", device="cpu", device_capacity=4, host_capacity=4) as s:
        assert torch.equal(s.read("t", torch.arange(100)), want)


def test_demo_bad_option_is_a_clear_error(tmp_path, capsys):
    assert main(["demo", "--policy", "nope", "--path", str(tmp_path / "d"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierstore demo: error:") and "nope" in err


def test_bench_policies_warns_when_a_tier_capacity_is_below_the_batch(tmp_path, capsys):
    """Issue 39 row 8: in tier mode a capacity below the batch size gets a warning and a flag."""
    out = tmp_path / "r.json"
    assert main(["bench-policies", "--trace", TRACE, "--policy", "lru,lfu", "--capacity", "50,400",
                 "--mode", "tier", "--batch-size", "100", "--no-progress", "--no-sizing",
                 "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert "capacities [50] below the batch size 100" in err
    recs = json.loads(out.read_text())
    assert {(r["capacity"], r["capacity_below_batch"]) for r in recs} == {(50, True), (400, False)}
    assert main(["bench-policies", "--trace", TRACE, "--policy", "lru", "--capacity", "400",
                 "--mode", "tier", "--batch-size", "100", "--no-progress", "--no-sizing"]) == 0
    assert "below the batch size" not in capsys.readouterr().err


def test_export_import_compact_expire_show_progress_bars(tmp_path, capsys):
    """Issue 39 row 6: the long commands draw a tqdm bar of rows on stderr (--no-progress: none)."""
    path = tmp_path / "s"
    with ts.TierStore(path, [ts.TableSpec("t", 10**9, 4)], device="cpu", device_capacity=0,
                      host_capacity=0) as s:
        s.apply("t", torch.arange(3000), torch.ones(3000, 4))
        s.advance(5)
        s.apply("t", torch.arange(100), torch.ones(100, 4))
        want = s.read("t", torch.tensor([5, 2999]))
    steps = [(["export", str(path), str(tmp_path / "e")], "export"),
             (["import", str(tmp_path / "e"), str(tmp_path / "i")], "import"),
             (["compact", str(path)], "compact"),
             (["expire", str(path), "--older-than", "2"], "expire, then compact")]
    for argv, desc in steps:
        assert main(argv) == 0
        err = capsys.readouterr().err
        assert f"{desc}:" in err and "row" in err, (argv, err)
    assert main(["compact", "--no-progress", str(tmp_path / "i")]) == 0
    assert "compact:" not in capsys.readouterr().err
    with ts.TierStore.open(tmp_path / "i", device="cpu", host_capacity=64) as again:
        assert torch.equal(again.read("t", torch.tensor([5, 2999])), want)  # the rows came back
