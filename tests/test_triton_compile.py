"""The Triton kernels compile for a real GPU (sm_90, PTX and cubin), on a machine without one.

Triton's interpreter runs the kernels on CPU tensors but never compiles them: it accepts code
the compiler refuses (a variable whose type differs between the branches of an `if`, a loop
value that changes type, a pointer of the wrong element type). Triton's NVIDIA backend (in the
PyPI wheel, with its own `ptxas`) compiles ahead of time without a GPU, so this compiles every
kernel variant the library launches, in a subprocess without TRITON_INTERPRET (under it
`triton.jit` makes interpreter objects), and checks the float math the bit-exactness rests on:
with fp fusion off, no `fma`, and only IEEE-rounded division and square root.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# triton is probed, not imported: importing it here, without TRITON_INTERPRET, would make the
# interpreter tests collected after this module in the same process run compiled kernels
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = r"""
import inspect, json, re, sys
try:  # Triton's NVIDIA backend, with the ahead-of-time API this drives (triton >= 3.3)
    from triton.backends import backends
    from triton.compiler import ASTSource
    usable = "nvidia" in backends and "constexprs" in inspect.signature(ASTSource).parameters
except ImportError:
    usable = False
if not usable:
    print(json.dumps({"skip": "no NVIDIA backend or AOT API here"}))
    sys.exit(0)
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as tcompile
import tierstore.backends.hbm_kernels as hk
import tierstore.engine.triton_backend as tb

PTR = {"src": "*fp32", "slots": "*i64", "work": "*fp32", "work_of": "*i64", "inverse": "*i64",
       "offsets": "*i64", "bag_out": "*i64", "bag_feat": "*i64", "psw": "*fp32",
       "feat_table": "*i64", "feat_col": "*i64", "feat_mode": "*i64", "tab_dim": "*i64",
       "out": "*fp32", "argmax": "*i64", "table": "*fp32", "u_table": "*i64", "perm": "*i64",
       "starts": "*i64", "bag_of": "*i64", "grad_out": "*fp32", "scale": "*fp32",
       "tab_kind": "*i64", "tab_params": "*fp64", "tab_clip": "*fp32", "goff": "*i64", "sscale": "*fp32",
       "src_stride": "i32", "work_stride": "i32", "out_stride": "i32", "am_stride": "i32",
       "tab_stride": "i32", "grad_stride": "i32", "lo": "i32", "finite": "*i1"}
HBM = {"table": "*i64", "keys": "*i64", "out": "*i64", "stamp": "*i64", "lock": "*i32",
       "rank": "*i64", "n": "i32", "sets": "i32"}
cases = []
for full in (True, False):
    for mx in (True, False):
        cases.append((tb._forward_kernel, PTR, dict(HAS_WORK=full, HAS_PSW=full, HAS_MAX=mx,
                                                     BLOCK_D=64 if full else 1)))
        cases.append((tb._backward_kernel, PTR, dict(HAS_WORK=full, HAS_SCALE=full, HAS_MAX=mx,
                                                      HAS_FLAG=full, NCH=8 if full else 1,
                                                      KB=tb.KB)))
ROWS = {"sk": "*i64", "perm": "*i64", "pos_table": "*i64", "useq": "*i64", "inverse": "*i64",
        "slots": "*i64", "u_table": "*i64", "starts": "*i64", "head": "*i64", "n": "i32"}
cases.append((tb._heads_kernel, ROWS, dict(BLOCK=tb.ROWS_BLOCK)))
cases.append((tb._keyed_rows_kernel, ROWS, dict(BLOCK=tb.ROWS_BLOCK)))
for direct in (True, False):
    cases.append((hk._lookup_kernel, HBM, dict(WAYS=32, BLOCK_N=64, DIRECT=direct)))
    cases.append((hk._choose_kernel, HBM, dict(WAYS=32, DIRECT=direct)))
out = []
for fn, types, consts in cases:
    sig = {a: "constexpr" if a in consts else types[a] for a in fn.arg_names}
    opts = {"enable_fp_fusion": False}  # and the warps the backend launches with
    if fn is tb._backward_kernel:
        opts["num_warps"] = tb._row_warps(8 * consts["NCH"])
    elif fn is tb._forward_kernel:
        opts["num_warps"] = max(1, min(4, consts["BLOCK_D"] // 32))
    try:
        k = tcompile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                     target=GPUTarget("cuda", 90, 32), options=opts)
    except Exception as exc:  # the compiler's refusal, reported by the test
        out.append({"kernel": fn.__name__, "consts": consts, "error": f"{type(exc).__name__}: {exc}"})
        continue
    ops = sorted(set(re.findall(r"\b((?:fma|div|sqrt|rcp)\.[a-z0-9.]+)", k.asm["ptx"])))
    out.append({"kernel": fn.__name__, "consts": consts, "cubin": len(k.asm["cubin"]), "ops": ops})
print(json.dumps(out))
"""


def test_every_kernel_variant_compiles_for_sm90_with_exact_float_math():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if isinstance(got, dict):
        pytest.skip(got["skip"])
    assert len(got) == 14
    errors = [g for g in got if "error" in g]
    assert not errors, json.dumps(errors, indent=1)[:6000]
    for g in got:
        assert g["cubin"] > 0, g
        inexact = [op for op in g["ops"] if op.startswith(("fma", "rcp"))
                   or op.startswith("div") and op not in ("div.rn.f32", "div.rn.f64")
                   or op.startswith("sqrt") and op not in ("sqrt.rn.f32", "sqrt.rn.f64")]
        assert not inexact, (g["kernel"], g["consts"], inexact)
    backward = [g for g in got if g["kernel"] == "_backward_kernel"]
    assert all({"div.rn.f32", "sqrt.rn.f32"} <= set(g["ops"]) for g in backward)
