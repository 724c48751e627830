"""The trainer's progress bar and its final table show one set of figures (issue 14, item 7)."""

from __future__ import annotations

from integration import train as tr
from tierstore.stats import progress_line


def test_final_table_matches_the_progress_bar(tmp_path, monkeypatch):
    seen = []
    orig = tr.Trainer._postfix

    def spy(self, st, *args):
        seen.append((self.step, st))
        return orig(self, st, *args)

    monkeypatch.setattr(tr.Trainer, "_postfix", spy)
    cfg = tr.TrainConfig(run_dir=str(tmp_path / "run"), tables="uniform:1000000", dim=8, batch=128,
                         steps=20, hot=500, bottom="16", top="16", eval_batches=3, eval_interval=0,
                         device_capacity="300", host_capacity="900", progress=True, lr=0.1,
                         dense_lr=0.01)
    t = tr.Trainer(cfg)
    try:
        s = t.run()
        after_eval = t.store.stats()
    finally:
        t.close()
    step, last = seen[-1]
    assert step == cfg.steps
    for tier in ("device", "host", "ssd"):
        assert s["tiers"][tier] == last[tier]
    # the held-out evaluation after training looked rows up too: those are not in the table
    assert after_eval["device"]["lookups"] > last["device"]["lookups"]
    text = tr.format_summary(s)
    bar = progress_line(last)
    host = f"{last['host']['hit_rate']:.3f}"
    assert f"host {host}" in bar
    host_row = next(ln for ln in text.splitlines() if ln.startswith("host "))
    assert f" {host} " in host_row
    ssd_row = next(ln for ln in text.splitlines() if ln.startswith("ssd "))
    assert "rows read" in ssd_row and "hit rate" not in ssd_row
