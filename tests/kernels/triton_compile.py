"""Compiling Triton kernels for sm90 without a GPU (to a cubin with triton's bundled ptxas), in a
subprocess without TRITON_INTERPRET: the check that a kernel the interpreter accepts also builds
for a Hopper GPU, without spilling registers or overflowing shared memory.

- `compile_for_sm90(script, tmp_path)`: runs `script`, which prints "compiled" and exits 0, or
  exits 3 with a reason to skip.
- `released_variants(tmp_path, reports)`: runs this file as a script (`main`), one subprocess for
  all the compiles. Every Triton launch that the released model's shapes make
  (presets.PRESETS["real"], bf16) is captured from the kernels' own wrappers, called as the
  engine calls them on meta tensors (nothing runs, no GPU), and specialised as triton's launcher
  would (its binder and `_pack_args`: pointer dtypes, constexprs, ints equal to 1 or divisible by
  16, num_warps / num_stages), then compiled for sm90. Returns one dict per variant: kernel,
  constexprs, options, the launches that use it, registers and spill bytes (from `ptxas -v`: a
  CompiledKernel's n_spills is filled only when a driver loads the binary), shared bytes, whether
  the PTX uses tensor cores. Skips (exit 3) where triton lacks the ahead-of-time API.

A variant is a kernel with its constexprs, pointer dtypes and options: launches that differ only
in the launcher's integer hints (a stride divisible by 16 or not, e.g. int4's packed rows of K / 8
words) share one compile, of the first launch (the decoder pass's shapes come first); `--all`
compiles each such specialisation too (their registers differ by a few; none spilled when this
was written). Compiles run in a fork pool, one worker per CPU (at most 4), and each report is
kept under `reports` by triton's own cache key of the compile (kernel source and the jit
functions it calls, constexprs, hints, options, triton and ptxas versions), so a rerun compiles
only what changed.

`--sass` adds each variant's SASS K loop and MMA layout to its report (`sass_report`: nvdisasm from
the triton wheel on the cubin, the TTGIR's warps; what scripts/roofline.py reads); `Launches.recorder`,
where set, is called with every captured launch (the roofline's per-launch bytes and grids).

    python tests/kernels/triton_compile.py [--list | --all] [--json] [--sass] [--reports DIR]
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

HOPPER_SHARED = 227 * 1024  # bytes of shared memory one block may use on an H100 / H200
H200_SMS = 132  # what triton_attention.pick_splits sees on an H200
REGISTERS_PER_SM = 65536  # a block of num_warps * 32 threads must fit: registers x threads <= this
MAX_WORKERS = 4


def _env(tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the launchers' enable_fp_fusion=True; quiets 3.9's warning
    return env


def compile_for_sm90(script: str, tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", script], env=_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    if done.returncode == 3:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def released_variants(
    tmp_path, reports=None, arch: int = 90, only: str | None = None, sass: bool = False
) -> list[dict]:
    """Every kernel variant of the released model's launches (`only`: those of one kernel, e.g.
    "_gemm_kernel:SCHEME=2"), compiled for sm`arch` (see the module); `sass`: with `sass_report`'s
    K loop and MMA layout."""
    cmd = [sys.executable, __file__, "--json", "--arch", str(arch)] + (["--reports", str(reports)] if reports else [])
    cmd += ["--only", only] if only else []
    cmd += ["--sass"] if sass else []
    done = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=1200)
    if done.returncode == 3:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def table(variants: list[dict], uses: bool = True) -> str:
    """The variants as a text table (for reports and failing asserts)."""
    rows = [("kernel", "constexprs", "warps/stages", "regs", "spill st/ld", "shared", "used by" if uses else "")]
    for v in variants:
        rows.append(
            (
                v["kernel"],
                " ".join(f"{k}={x}" for k, x in v["constexprs"].items()),
                f"{v['num_warps']}/{v['num_stages']}",
                str(v.get("registers", "-")),
                f"{v.get('spill_stores', '-')}/{v.get('spill_loads', '-')}",
                str(v.get("shared", "-")),
                "; ".join(v["used_by"]) if uses else "",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1]).rstrip() for r in rows)


# ------------------------------------------------------------------------------ the subprocess
PTXAS_FUNCTION = re.compile(
    r"Function properties for (\S+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")
TENSOR_CORES = re.compile(r"\b(?:wgmma|mma)\.")


LABEL = re.compile(r"^(\$L__\w+):")
BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+);")
GLOBAL_LOAD = re.compile(r"\bld\.global\S*")
CP_ASYNC = re.compile(r"\bcp\.async\.\S+\s+\[[^\]]+\],\s*\[[^\]]+\],\s*(0x[0-9a-fA-F]+|\d+)")
WIDTH = re.compile(r"\.[bsuf](8|16|32|64)\b")
VECTOR = re.compile(r"\.v(2|4|8)\.")


def load_bytes(op: str) -> int:
    """Bytes one thread requests with a PTX global load (`ld.global.v4.b32` -> 16)."""
    width = WIDTH.findall(op)
    vector = VECTOR.search(op)
    return (int(vector.group(1)) if vector else 1) * int(width[-1]) // 8 if width else 0


def k_loop(ptx: str) -> dict | None:
    """The innermost loop of the PTX that holds a tensor-core instruction (a matmul's K loop):
    its global loads' count and bytes per thread per iteration (ld.global and cp.async), the
    smallest load, and its MMA instructions. None where no loop holds one."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := LABEL.match(line.strip()))}
    loops = []
    for j, line in enumerate(lines):
        m = BRANCH.search(line)
        if m and m.group(1) in labels and labels[m.group(1)] < j:
            loops.append((labels[m.group(1)], j))
    found = [(end - start, start, end) for start, end in loops if any(TENSOR_CORES.search(x) for x in lines[start:end])]
    if not found:
        return None
    _, start, end = min(found)
    body = lines[start:end]
    sizes = [load_bytes(m.group(0)) for x in body for m in GLOBAL_LOAD.finditer(x)]
    sizes += [int(m.group(1), 0) for x in body for m in CP_ASYNC.finditer(x)]
    return dict(
        loads=len(sizes),
        bytes=sum(sizes),
        smallest=min(sizes) if sizes else 0,
        mma=sum(bool(TENSOR_CORES.search(x)) for x in body),
    )


SASS_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)")
SASS_LABEL = re.compile(r"^(\.L_\w+):")
SASS_BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+`?\(?(\.L_\w+)\)?")
SASS_MMA = re.compile(r"^(?:HMMA|HGMMA|IMMA|IGMMA|QGMMA|HFMA2\.MMA)\b")
SASS_WIDTH = re.compile(r"\.[US]?(8|16|32|64|128)\b")
SASS_MATRICES = re.compile(r"\.(1|2|4)$")  # ldmatrix's .x1 / .x2 / .x4 (none: one)
SASS_GMMA_SHAPE = re.compile(r"^[A-Z]+GMMA\.(\d+)x(\d+)x(\d+)\.\w+\.(\w+)")
GMMA_BYTES = {"BF16": 2, "F16": 2, "TF32": 4, "E4M3": 1, "E5M2": 1, "S8": 1, "U8": 1}
TTGIR_MMA = re.compile(
    r"#ttg\.nvidia_mma<\{versionMajor = (\d+), versionMinor = \d+, warpsPerCTA = \[([\d, ]+)\]"
    r"(?:, [^}]*?)?instrShape = \[([\d, ]+)\]"
)
TTGIR_WARPS = re.compile(r'"ttg\.num-warps" = (\d+)')
SASS_REPORT = 1  # the version of `sass_report`'s reading: a cached report of another is compiled again


def shared_bytes(op: str, line: str) -> float:
    """Bytes of shared memory one warp's instruction reads or writes (ldmatrix: 128 bytes a
    matrix; LDS / STS / LDGSTS: the width times 32 threads; a warpgroup MMA's shared operands: a
    quarter of the warpgroup's, so a count per warp times num_warps is the CTA's)."""
    if op.startswith("LDSM"):
        m = SASS_MATRICES.search(op)
        return 128 * (int(m.group(1)) if m else 1)
    if op.split(".")[0] in ("LDS", "STS", "LDGSTS"):
        widths = SASS_WIDTH.findall(op)
        return 32 * (int(widths[-1]) if widths else 32) / 8
    m = SASS_GMMA_SHAPE.match(op)
    if m and "gdesc" in line:
        rows, cols, depth, kind = int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4)
        size = GMMA_BYTES.get(kind, 2)
        a_shared = re.search(r"GMMA\S*\s+R\d+,\s*gdesc", line) is not None  # A and B by descriptors
        return ((rows * depth if a_shared else 0) + cols * depth) * size / 4
    return 0.0


def sass_k_loop(sass: str) -> dict | None:
    """The innermost loop of an `nvdisasm -c` listing that holds an MMA instruction (a matmul's K
    loop): its instructions (one K step, per warp), its MMA instructions and their opcodes, the
    shared memory bytes it reads and writes (per warp). None where no loop holds one."""
    ops: list[tuple[str, str]] = []  # (opcode, line) in order
    labels: dict[str, int] = {}
    branches: list[tuple[int, str]] = []
    for line in sass.splitlines():
        m = SASS_LABEL.match(line.strip())
        if m:
            labels[m.group(1)] = len(ops)
            continue
        m = SASS_INSTRUCTION.match(line)
        if not m:
            continue
        b = SASS_BRANCH.search(line)
        if b:
            branches.append((len(ops), b.group(1)))
        ops.append((m.group(1), line))
    loops = [(labels[t], at + 1) for at, t in branches if t in labels and labels[t] <= at]
    found = [(end - start, start, end) for start, end in loops if any(SASS_MMA.match(o) for o, _ in ops[start:end])]
    if not found:
        return None
    _, start, end = min(found)
    body = ops[start:end]
    mma = [o for o, _ in body if SASS_MMA.match(o)]
    return dict(
        instructions=end - start,
        mma=len(mma),
        mma_ops=sorted(set(mma)),
        shared_bytes=sum(shared_bytes(o, line) for o, line in body),
    )


def weight_bytes_a_k_step(v: dict) -> float:
    """Bytes of weights one K step of a `_gemm_kernel` variant reads (a CTA's): its BLOCK_N rows (2
    BLOCK_N for gate|up) of BLOCK_K inputs, packed bytes for 4-bit (scales left out), the stored
    element's size else."""
    c = v["constexprs"]
    if c["SCHEME"] in (0, 3):
        per_weight = 0.5
    elif c["SCHEME"] in (1, 2):
        per_weight = 1
    else:  # a full-precision weight, as its pointer's type
        per_weight = {"*bf16": 2, "*fp16": 2, "*fp32": 4}[v["pointers"]["w_ptr"]]
    return (2 if c["DUAL"] else 1) * c["BLOCK_N"] * c["BLOCK_K"] * per_weight


def k_loop_metric(v: dict) -> float:
    """Issue 54's metric of a `_gemm_kernel` variant compiled with `--sass`: K-loop SASS
    instructions x num_warps / weight bytes a K step (above ~0.22 an H200's SM is bound by issuing
    instructions, not by the bytes it receives)."""
    sass = v["sass"]
    return sass["k_loop"]["instructions"] * sass["num_warps"] / weight_bytes_a_k_step(v)


def mma_depth(v: dict) -> int:
    """The K an MMA instruction of a `_gemm_kernel` variant covers: the TTGIR's instruction shape
    where it says (wgmma: [16, N, K]), else 32 for e4m3 x e4m3 (W8A8 on the hardware), 16 else."""
    instr = v["sass"]["mma_layouts"][0]["instr"]
    if len(instr) > 2:
        return instr[2]
    c = v["constexprs"]
    return 32 if c.get("A8") and c.get("FP8_CVT") else 16


def mma_issued_and_minimum(v: dict) -> tuple[int, int]:
    """(MMA instructions a K step issues, a CTA's: wgmma counted once a warpgroup; the fewest its
    tile needs at the compiled instruction shape) of a `_gemm_kernel` variant compiled with `--sass`."""
    c, sass = v["constexprs"], v["sass"]
    layout = sass["mma_layouts"][0]
    wgmma = layout["version"] >= 3
    issued = sass["k_loop"]["mma"] * sass["num_warps"] // (4 if wgmma else 1)
    width = (2 if c["DUAL"] else 1) * c["BLOCK_N"]  # gate|up: one tile of both halves
    rows = 64 if wgmma else layout["instr"][0]  # a warpgroup's 64 rows
    minimum = -(-c["BLOCK_M"] // rows) * -(-width // layout["instr"][1]) * (c["BLOCK_K"] // mma_depth(v))
    return issued, minimum


def mma_layouts(ttgir: str) -> list[dict]:
    """The TTGIR's tensor-core layouts: MMA version (2: mma.sync, 3: wgmma), warpsPerCTA and the
    instruction shape, in the order they are declared."""
    return [
        dict(
            version=int(m.group(1)),
            warps=[int(x) for x in m.group(2).split(",")],
            instr=[int(x) for x in m.group(3).split(",")],
        )
        for m in TTGIR_MMA.finditer(ttgir)
    ]


def sass_report(kernel) -> dict:
    """What the roofline reads from a compiled kernel (its cubin disassembled by the wheel's
    nvdisasm, its TTGIR): the SASS K loop, the count of all SASS instructions, the MMA layouts, the warps."""
    import tempfile

    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run(
            [knobs.nvidia.nvdisasm.path, "-c", path], capture_output=True, text=True, check=True
        ).stdout
    ttgir = kernel.asm["ttgir"]
    warps = TTGIR_WARPS.search(ttgir)
    return dict(
        version=SASS_REPORT,
        k_loop=sass_k_loop(sass),
        instructions=sum(1 for line in sass.splitlines() if SASS_INSTRUCTION.match(line)),
        mma_layouts=mma_layouts(ttgir),
        num_warps=int(warps.group(1)) if warps else None,
    )


def _ptxas_report(log: str, name: str) -> dict:
    """Registers, spills, stack and static shared bytes of kernel `name` from a `ptxas -v` log."""
    out = {}
    for m in PTXAS_FUNCTION.finditer(log):
        if m.group(1) == name:
            out.update(stack=int(m.group(2)), spill_stores=int(m.group(3)), spill_loads=int(m.group(4)))
    start = log.find(f"Compiling entry function '{name}'")
    m = PTXAS_USED.search(log, max(start, 0))
    if m:
        out.update(registers=int(m.group(1)), static_shared=int(m.group(2) or 0))
    return out


def _run_ptxas(ptx: str, name: str, arch: str, fp_fusion: bool) -> dict:
    """ptxas -v on the kernel's PTX, as triton's make_cubin runs it (for a triton cache hit,
    which builds no cubin and so logs nothing)."""
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        fmad = [] if fp_fusion else ["--fmad=false"]
        cmd = [
            get_ptxas(90).path,
            "-lineinfo",
            *fmad,
            "-v",
            "--regAllocOptLevel=2",
            f"--gpu-name={arch}",
            src,
            "-o",
            src + ".o",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return _ptxas_report(done.stderr + done.stdout, name)


class Launches:
    """Stands in for the kernels' launcher: each launch is specialised as triton's JITFunction.run
    would (its own binder and _pack_args, for an sm90 target) and recorded, not run."""

    def __init__(self, target, exact: bool = False, sass: bool = False):
        from triton.compiler import make_backend

        self.target = target
        self.backend = make_backend(target)
        self.exact = exact  # one variant per launcher specialisation, integer hints included
        self.sass = sass  # each compile's report holds `sass_report` too
        self.variants: dict[str, dict] = {}
        self.label = ""
        self.recorder = None  # called as recorder(key, fn, args, kwargs, grid) for every launch captured

    def capture(self, fn) -> None:
        from triton import knobs
        from triton.runtime.jit import create_function_from_signature

        binder = create_function_from_signature(fn.signature, fn.params, self.backend)
        declared = {i for i, p in enumerate(fn.params) if p.is_constexpr}

        def run(*args, grid, warmup, **kwargs):
            kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
            kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
            kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
            bound, specialization, options = binder(*args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound, specialization, options)
            if self.exact:
                key = (sorted(signature.items()), sorted(constexprs.items()), sorted(attrs.items()))
            else:  # the kernel's own constexprs and pointer dtypes
                pointers = sorted((k, t) for k, t in signature.items() if t.startswith("*"))
                key = (pointers, sorted((k, v) for k, v in constexprs.items() if k[0] in declared))
            key = repr((fn.__name__, key, options))
            entry = self.variants.setdefault(
                key,
                dict(
                    fn=fn,
                    signature=signature,
                    constexprs=constexprs,
                    attrs=attrs,
                    options=options,
                    used_by=[],
                    grids={},
                ),
            )
            if self.label not in entry["used_by"]:
                entry["used_by"].append(self.label)
            g = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
            entry["grids"].setdefault(self.label, []).append([int(v) for v in g])
            if self.recorder is not None:
                self.recorder(key, fn, args, kwargs, [int(v) for v in g])

        fn.run = run

    def summary(self, entry: dict) -> dict:
        fn, options = entry["fn"], entry["options"]
        declared = {p.name for p in fn.params if p.is_constexpr}
        names = fn.arg_names
        constexprs = {
            names[k[0]]: entry["constexprs"][k] for k in sorted(entry["constexprs"]) if names[k[0]] in declared
        }
        pointers = {n: t for n, t in entry["signature"].items() if t.startswith("*")}
        plain = (int, float, str, bool, type(None))
        return dict(
            kernel=fn.__name__,
            constexprs={k: v if isinstance(v, plain) else str(v) for k, v in constexprs.items()},
            num_warps=options.num_warps,
            num_stages=options.num_stages,
            pointers=pointers,
            used_by=entry["used_by"],
            grids=entry.get("grids", {}),
        )

    def cache_key(self, entry: dict) -> str:
        """triton's own key of this compile (triton.compile's cache key, hashed)."""
        import hashlib

        from triton.compiler import ASTSource
        from triton.compiler.compiler import (
            get_cache_invalidating_env_vars,
            get_cache_key,
        )

        src = ASTSource(entry["fn"], entry["signature"], entry["constexprs"], entry["attrs"])
        options = self.backend.parse_options(entry["options"].__dict__)
        return hashlib.sha256(
            get_cache_key(src, self.backend, options, get_cache_invalidating_env_vars()).encode()
        ).hexdigest()

    def compile(self, entry: dict) -> dict:
        """Compile one variant for sm90: registers, spills and stack (ptxas -v), shared bytes
        (triton's allocation plus any static), tensor-core instructions in the PTX."""
        import contextlib
        import io
        import time

        import triton
        from triton import knobs
        from triton.compiler import ASTSource

        began = time.perf_counter()
        fn, options = entry["fn"], entry["options"]
        log = io.StringIO()
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):  # make_cubin prints the ptxas -v log there
            kernel = triton.compile(
                ASTSource(fn, entry["signature"], entry["constexprs"], entry["attrs"]),
                target=self.target,
                options=options.__dict__,
            )
        name, ptx = kernel.metadata.name, kernel.asm["ptx"]
        report = _ptxas_report(log.getvalue(), name)
        if "registers" not in report or "spill_stores" not in report:
            arch = f"sm_{self.target.arch}a" if self.target.arch >= 90 else f"sm_{self.target.arch}"
            report = _run_ptxas(ptx, name, arch, options.enable_fp_fusion)
        if "registers" not in report or "spill_stores" not in report:
            raise RuntimeError(f"no registers / spills for {name} in ptxas -v's log:\n{log.getvalue()}")
        report.update(
            shared=kernel.metadata.shared + report.get("static_shared", 0),
            tensor_cores=bool(TENSOR_CORES.search(ptx)),
            seconds=round(time.perf_counter() - began, 2),
            k_loop=k_loop(ptx),
            arch=self.target.arch,
        )
        if self.sass:
            report["sass"] = sass_report(kernel)
        if os.environ.get(
            "DGEMMA_PTX_DIR"
        ):  # the PTX itself, for reading (gpu_check writes it under its output folder)
            os.makedirs(os.environ["DGEMMA_PTX_DIR"], exist_ok=True)
            with open(os.path.join(os.environ["DGEMMA_PTX_DIR"], f"{name}.sm{self.target.arch}.ptx"), "w") as f:
                f.write(ptx)
        return report


_LAUNCHES: Launches | None = None  # the fork pool's workers read the entries from here


def _compile_index(index: int) -> dict:
    return _LAUNCHES.compile(list(_LAUNCHES.variants.values())[index])


def kernel_modules() -> tuple:
    """dgemma's modules of Triton kernels (every `*_kernel` in them is compiled here)."""
    from dgemma.kernels import (
        triton_ar,
        triton_attention,
        triton_layer,
        triton_moe,
        triton_norms,
        triton_quant,
        triton_step,
        triton_turbo,
    )

    return (
        triton_step,
        triton_ar,
        triton_turbo,
        triton_layer,
        triton_attention,
        triton_quant,
        triton_moe,
        triton_norms,
    )


def _launch_released(launches: Launches) -> None:
    """Every Triton launch the engine makes at the released model's shapes (presets "real") on
    meta tensors, captured, nothing run: whole engine steps (tests/launch_count.py's driver, with
    an H200's choices) for each weight format at batch 1 and a larger batch, an encoder pass, an AR
    token, a turbo pass, and
    the wrappers the steps do not reach (the unfused LoRA path's kernels, turbo's separate draws
    and sampling, quantised linears at a short prefill chunk's rows)."""
    import torch

    from dgemma.kernels import (
        triton_attention,
        triton_layer,
        triton_quant,
        triton_step,
    )
    from dgemma.model.checkpoint import make_config
    from dgemma.model.diffusion_gemma import Experts
    from dgemma.model.presets import PRESETS
    from dgemma.quant.formats import DEFAULT_GROUP_SIZE, SCHEMES, quantize
    from launch_count import ar_token_launches, encode_launches, h200, released_net, step_launches

    modules = kernel_modules()
    for fn in [getattr(m, name) for m in modules for name in dir(m) if name.endswith("_kernel")]:
        launches.capture(fn)

    for scheme in (None, "fp8", "int4", "nvfp4"):
        net = released_net(scheme)
        for batch in (1, 4) if scheme in (None, "nvfp4") else (1,):  # the decoder pass's shapes first
            launches.label = f"prompts {scheme or 'bf16'} batch {batch}"
            step_launches(
                net,
                batch,
                on_counted=lambda b=batch, s=scheme: setattr(launches, "label", f"step {s or 'bf16'} batch {b}"),
            )
        launches.label = f"encode {scheme or 'bf16'}"
        encode_launches(net)
        if scheme is None:  # AR mode's captured token (engine/fused/ar.py): slots, argmax, advance
            launches.label = "AR token bf16"
            ar_token_launches(net)
            launches.label = "turbo bf16 batch 1"  # the fused turbo pass (engine/fused/turbo.py)
            step_launches(net, 1, turbo=True)

    cfg = make_config(**PRESETS["real"])
    dt, meta, c = torch.bfloat16, torch.device("meta"), cfg.canvas_length
    h, v = cfg.hidden_size, cfg.vocab_size

    def empty(*shape, dtype=dt):
        return torch.empty(*shape, dtype=dtype, device=meta)

    with h200():
        launches.label = "turbo's draws and sampling"
        uniforms, _ = triton_step.philox_draws(empty(1, dtype=torch.long), empty(1, dtype=torch.long), c, v)
        triton_step.sample_rows(empty(c, v), None, uniforms.view(-1))
        # an encode with an image (bidirectional vision): the prefix attention's image mask, both head dims
        launches.label = "encode with an image"
        for d, hkv, window in ((256, 8, cfg.sliding_window), (512, 2, None)):
            pool, i32 = empty(64, 256, hkv, d), torch.int32
            triton_attention.paged_prefix_attention(
                empty(1, cfg.num_heads, 512, d), pool, pool, empty(1, 64, dtype=i32), empty(1, dtype=i32),
                empty(1, dtype=i32), window, empty(1, 512, dtype=i32),
            )  # fmt: skip
        # the unfused path (a layer with LoRA adapters): norm_rope, gelu_mul, the MoE block with combine_topk
        for d in (256, 512):
            launches.label = f"norm_rope D={d}"
            x = empty(c, 2, d)
            triton_layer.norm_rope(x, empty(d), empty(c, d), empty(c, d), 1e-6)
            triton_layer.norm_rope(x, None, None, None, 1e-6)
        with torch.device(meta):
            experts = Experts(cfg).to(dt)
        launches.label = "moe_experts (unfused)"
        triton_layer.moe_experts(
            experts,
            empty(c, h),
            empty(c, cfg.top_k_experts, dtype=torch.long),
            empty(c, cfg.top_k_experts, dtype=torch.float32),
        )
        # quantised linears at a prefill chunk's and a short pass's rows
        for scheme in SCHEMES:
            q = quantize(empty(cfg.intermediate_size, h, dtype=torch.float32), scheme, DEFAULT_GROUP_SIZE, dt)
            for tokens in (16, 64, 2048):
                launches.label = f"{scheme} linear M={tokens}"
                triton_quant.quant_linear(empty(tokens, h), q)


def _compile_all(launches: Launches, reports: str | None) -> list[dict]:
    """Each variant's summary and compile report: from `reports` where a compile with the same
    triton cache key was reported before, the rest compiled in a fork pool."""
    import multiprocessing

    global _LAUNCHES
    entries = list(launches.variants.values())
    keys = [launches.cache_key(entry) for entry in entries] if reports else [None] * len(entries)
    found: dict[int, dict] = {}
    for index, key in enumerate(keys):
        path = key and os.path.join(reports, key + ".json")
        if path and os.path.exists(path):
            with open(path) as f:
                cached = json.load(f)
            if not launches.sass or cached.get("sass", {}).get("version") == SASS_REPORT:  # else compiled again
                found[index] = dict(cached, cached=True)
    todo = [index for index in range(len(entries)) if index not in found]
    workers = min(MAX_WORKERS, len(os.sched_getaffinity(0)), len(todo))
    _LAUNCHES = launches
    if workers > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            done = pool.map(_compile_index, todo, chunksize=1)
    else:
        done = [_compile_index(index) for index in todo]
    for index, report in zip(todo, done):
        found[index] = report
        if reports:
            os.makedirs(reports, exist_ok=True)
            path = os.path.join(reports, keys[index] + ".json")
            with open(f"{path}.{os.getpid()}", "w") as f:
                json.dump(report, f)
            os.replace(f"{path}.{os.getpid()}", path)  # whole or absent, for a concurrent reader
    return [dict(launches.summary(entry), **found[index]) for index, entry in enumerate(entries)]


def compile_all(launches: Launches, reports: str | None = None) -> list[dict]:
    """Every variant `launches` captured, compiled (or its report read from `reports`), in the
    order captured: the public name of the driver's compile step (scripts/roofline.py calls it)."""
    return _compile_all(launches, reports)


def main(argv: list[str]) -> int:
    import inspect

    try:
        import triton  # noqa: F401
        from triton import knobs
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import get_ptxas
        from triton.compiler import ASTSource
        from triton.compiler.compiler import (  # noqa: F401
            get_cache_invalidating_env_vars,
            get_cache_key,
        )
        from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: F401

        assert {"constexprs", "attrs"} <= set(inspect.signature(ASTSource).parameters), "ASTSource(constexprs, attrs)"
        assert hasattr(JITFunction, "_pack_args"), "JITFunction._pack_args"
        assert hasattr(knobs.nvidia, "dump_ptxas_log"), "knobs.nvidia.dump_ptxas_log"
        assert os.path.exists(get_ptxas(90).path), "triton's bundled ptxas"
    except Exception as e:  # noqa: BLE001
        print(f"no ahead-of-time compile API here: {e!r}")
        return 3
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: the kernels would be built for the interpreter")
        return 3
    arch = int(argv[argv.index("--arch") + 1]) if "--arch" in argv else 90
    only = argv[argv.index("--only") + 1] if "--only" in argv else None  # e.g. "_gemm_kernel:SCHEME=2"
    launches = Launches(GPUTarget("cuda", arch, 32), exact="--all" in argv, sass="--sass" in argv)
    from dgemma.kernels import triton_quant

    triton_quant.ARCH_ON_META = arch  # the wrappers choose for the target (sm80: e4m3 decoded by bits)
    _launch_released(launches)
    if only is not None:  # compile only the variants of one kernel (and constexpr) named
        kernel, _, constexpr = only.partition(":")
        for key, entry in list(launches.variants.items()):
            summary = launches.summary(entry)
            name, _, value = constexpr.partition("=")
            if summary["kernel"] != kernel or (name and str(summary["constexprs"].get(name)) != value):
                del launches.variants[key]
    reports = argv[argv.index("--reports") + 1] if "--reports" in argv else None
    if "--list" in argv:
        out = [launches.summary(entry) for entry in launches.variants.values()]
    else:
        out = _compile_all(launches, reports)
    if "--json" in argv:
        for row in out:
            print(json.dumps(row))
    else:
        print(table(out))
    return 0


if __name__ == "__main__":
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [os.path.dirname(tests), tests]  # the package, and the helpers tests share (launch_count.py)
    sys.exit(main(sys.argv[1:]))
