"""kernels/triton_lora.py's shrink and expand compile for a Hopper GPU (sm90) without one: triton's
ahead-of-time compile with its bundled ptxas, in a subprocess without TRITON_INTERPRET, for one to
three linears side by side; bf16 (the released model's dtype) spills no register."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
pytestmark = [pytest.mark.triton, pytest.mark.subprocess, pytest.mark.slow]

SCRIPT = r"""
import contextlib, io, json, re, sys
try:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:
    print(f"no ahead-of-time compile here: {e}"); sys.exit(3)
from dgemma.kernels import triton_lora as lora

knobs.nvidia.dump_ptxas_log = True
for dtype in ("bf16", "fp32"):
    for parts in (1, 2, 3):
        for fn, extra in ((lora._shrink_kernel, {"BLOCK_K": lora.BLOCK_K}), (lora._expand_kernel, {"BLOCK_N": lora.BLOCK_N})):
            consts = dict(extra, PARTS=parts, RP=16, BLOCK_M=lora.BLOCK_M)
            signature, constexprs = {}, {}
            for i, n in enumerate(fn.arg_names):
                if n in consts:
                    signature[n], constexprs[(i,)] = "constexpr", consts[n]
                elif n.endswith("_ptr"):
                    signature[n] = {"slot_ptr": "*i32", "low_ptr": "*fp32"}.get(n, "*" + dtype)
                else:
                    signature[n] = "i32"
            log = io.StringIO()
            with contextlib.redirect_stdout(log):
                k = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                                   options={"num_warps": 4})
            spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", log.getvalue()))
            regs = max([int(x) for x in re.findall(r"Used (\d+) registers", log.getvalue())] or [0])
            print(json.dumps({"kernel": fn.__name__, "dtype": dtype, "parts": parts, "shared": k.metadata.shared,
                              "registers": regs, "spills": spills}))
print("compiled")
"""


def test_shrink_and_expand_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode == 3:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 12
    for r in reports:
        assert r["shared"] <= 227 * 1024 and r["registers"] * 128 <= 65536, r
        if r["dtype"] == "bf16":
            assert r["spills"] == 0, r
