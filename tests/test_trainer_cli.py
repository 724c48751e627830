"""The trainer's command line (issue 39 row 11): every option has help, and each valued option
shows its default (and --demo's where the preset differs)."""

from __future__ import annotations

import argparse

from integration.train import DEMO, build_parser


def test_every_trainer_option_has_help_and_a_default():
    ap = build_parser()
    for action in ap._actions:
        assert action.help, f"{action.option_strings} has no help"
        takes_value = action.nargs != 0 and not isinstance(action, argparse._HelpAction)
        if takes_value:
            assert "default" in action.help, f"{action.option_strings} shows no default"
    text = " ".join(ap.format_help().split())
    assert "--steps STEPS training steps" in text and "(default: 200; --demo: 300)" in text
    assert "--ttl TTL expire rows" in text and "(default: none)" in text
    assert set(DEMO) <= {a.dest for a in ap._actions}


def _train_warnings_as_errors(rank, world, root):
    import warnings

    from integration.distributed import run_distributed
    from integration.train import TrainConfig

    warnings.filterwarnings("error", message=".*requires_grad=True to a scalar.*")
    cfg = TrainConfig(run_dir=root, tables="uniform:500", dim=4, steps=10, batch=32, eval_batches=1,
                      progress=True, device_capacity="40", host_capacity="40", bottom="8", top="8")
    return run_distributed(cfg, sharding="row", timeout_s=60)


def test_distributed_trainer_progress_converts_no_tensor_that_requires_grad(tmp_path):
    """Issue 39 row 12: the 2-rank trainer's progress line printed a loss that requires grad."""
    from tierstore.distributed.launch import run_local

    out = run_local(2, _train_warnings_as_errors, str(tmp_path / "r"), timeout_s=240,
                    preload=["integration.distributed", __name__])
    assert out[0]["steps"] == 10
