"""The `tierstore` command's startup: --version, help text for every command and argument, and
which commands import torch (the help and `info` must not; timing is `bench.cli_startup`)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tierstore as ts
from tierstore.cli import _forwarded, build_parser, main

REPO = Path(__file__).resolve().parents[1]


def _native() -> list[str]:
    """Every subcommand this parser parses itself (the forwarded ones have their module's help)."""
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [c for c in action.choices if c not in _forwarded()]


NATIVE = _native()


def _run_py(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"tierstore {ts.__version__}"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("cmd", NATIVE)
def test_every_command_has_a_description_and_every_argument_help(cmd, capsys):
    p = _subparsers(build_parser())[cmd]
    assert p.description and len(p.description) > 20
    for action in p._actions:
        assert action.help, f"{cmd}: {action.dest} has no help"
    with pytest.raises(SystemExit):
        main([cmd, "--help"])
    out = capsys.readouterr().out
    for line in out.splitlines():
        assert line.count("default") <= 1, f"doubled default in {cmd} --help: {line!r}"
    assert "(default: None)" not in out and "(default: False)" not in out


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["info", "--help"], ["export", "--help"],
                                  ["expire", "--help"], ["demo", "--help"]])
def test_help_does_not_import_torch(argv):
    out = _run_py(f"""
import sys
from tierstore.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
print("TORCH", "torch" in sys.modules, "numba" in sys.modules)
""")
    assert out.strip().splitlines()[-1] == "TORCH False False"


def test_info_does_not_import_torch(tmp_path):
    path = tmp_path / "s"
    store = ts.TierStore(path, [ts.TableSpec("t", 10**9, 4)], device="cpu")
    import torch

    store.apply("t", torch.arange(5), torch.ones(5, 4))
    store.close()
    out = _run_py(f"""
import sys
from tierstore.cli import main
assert main(["info", {str(path)!r}]) == 0
print("TORCH", "torch" in sys.modules, "numba" in sys.modules)
""")
    assert "rows stored" in out and re.search(r" 5 +(chunks|btree)\n", out)
    assert out.strip().splitlines()[-1] == "TORCH False False"


def test_lazy_package_attributes():
    assert ts.TierStore.__name__ == "TierStore" and ts.Prefetcher.__name__ == "Prefetcher"
    assert set(ts.__all__) <= set(dir(ts))
    assert ts.store.TierStore is ts.TierStore  # submodules resolve too
    with pytest.raises(AttributeError):
        ts.no_such_name  # noqa: B018


def test_bench_cli_startup_smoke(tmp_path):
    import json

    from bench import cli_startup

    assert cli_startup.main(["--runs", "1", "--out", str(tmp_path)]) == 0
    recs = json.loads((tmp_path / "cli_startup.json").read_text())["records"]
    assert {r["command"] for r in recs} >= {"tierstore --help", "tierstore info PATH"}
    assert all(r["median_s"] > 0 for r in recs)
