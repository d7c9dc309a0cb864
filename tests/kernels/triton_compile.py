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

    python tests/kernels/triton_compile.py [--list | --all] [--json] [--reports DIR]
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
    done = subprocess.run([sys.executable, "-c", script], env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    if done.returncode == 3:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def released_variants(tmp_path, reports=None) -> list[dict]:
    """Every kernel variant of the released model's launches, compiled for sm90 (see the module)."""
    cmd = [sys.executable, __file__, "--json"] + (["--reports", str(reports)] if reports else [])
    done = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=1200)
    if done.returncode == 3:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def table(variants: list[dict], uses: bool = True) -> str:
    """The variants as a text table (for reports and failing asserts)."""
    rows = [("kernel", "constexprs", "warps/stages", "regs", "spill st/ld", "shared", "used by" if uses else "")]
    for v in variants:
        rows.append((
            v["kernel"], " ".join(f"{k}={x}" for k, x in v["constexprs"].items()), f"{v['num_warps']}/{v['num_stages']}",
            str(v.get("registers", "-")), f"{v.get('spill_stores', '-')}/{v.get('spill_loads', '-')}",
            str(v.get("shared", "-")), "; ".join(v["used_by"]) if uses else "",
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1]).rstrip() for r in rows)


# ------------------------------------------------------------------------------ the subprocess
PTXAS_FUNCTION = re.compile(r"Function properties for (\S+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")
TENSOR_CORES = re.compile(r"\b(?:wgmma|mma)\.")


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
        cmd = [get_ptxas(90).path, "-lineinfo", *fmad, "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", src, "-o", src + ".o"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return _ptxas_report(done.stderr + done.stdout, name)


class Launches:
    """Stands in for the kernels' launcher: each launch is specialised as triton's JITFunction.run
    would (its own binder and _pack_args, for an sm90 target) and recorded, not run."""

    def __init__(self, target, exact: bool = False):
        from triton.compiler import make_backend

        self.target = target
        self.backend = make_backend(target)
        self.exact = exact  # one variant per launcher specialisation, integer hints included
        self.variants: dict[str, dict] = {}
        self.label = ""

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
            entry = self.variants.setdefault(key, dict(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs,
                                                       options=options, used_by=[]))  # fmt: skip
            if self.label not in entry["used_by"]:
                entry["used_by"].append(self.label)

        fn.run = run

    def summary(self, entry: dict) -> dict:
        fn, options = entry["fn"], entry["options"]
        declared = {p.name for p in fn.params if p.is_constexpr}
        names = fn.arg_names
        constexprs = {names[k[0]]: entry["constexprs"][k] for k in sorted(entry["constexprs"]) if names[k[0]] in declared}
        pointers = {n: t for n, t in entry["signature"].items() if t.startswith("*")}
        plain = (int, float, str, bool, type(None))
        return dict(kernel=fn.__name__, constexprs={k: v if isinstance(v, plain) else str(v) for k, v in constexprs.items()},
                    num_warps=options.num_warps, num_stages=options.num_stages, pointers=pointers,
                    used_by=entry["used_by"])  # fmt: skip

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
        return hashlib.sha256(get_cache_key(src, self.backend, options, get_cache_invalidating_env_vars()).encode()).hexdigest()

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
            kernel = triton.compile(ASTSource(fn, entry["signature"], entry["constexprs"], entry["attrs"]),
                                    target=self.target, options=options.__dict__)  # fmt: skip
        name, ptx = kernel.metadata.name, kernel.asm["ptx"]
        report = _ptxas_report(log.getvalue(), name)
        if "registers" not in report or "spill_stores" not in report:
            report = _run_ptxas(ptx, name, f"sm_{self.target.arch}a", options.enable_fp_fusion)
        if "registers" not in report or "spill_stores" not in report:
            raise RuntimeError(f"no registers / spills for {name} in ptxas -v's log:\n{log.getvalue()}")
        report.update(shared=kernel.metadata.shared + report.get("static_shared", 0),
                      tensor_cores=bool(TENSOR_CORES.search(ptx)), seconds=round(time.perf_counter() - began, 2))  # fmt: skip
        return report


_LAUNCHES: Launches | None = None  # the fork pool's workers read the entries from here


def _compile_index(index: int) -> dict:
    return _LAUNCHES.compile(list(_LAUNCHES.variants.values())[index])


def _launch_released(launches: Launches) -> None:
    """Call every Triton wrapper the engine calls, with the released model's shapes on meta
    tensors, as the engine calls them (kernel launches are captured, nothing runs)."""
    import torch

    from dgemma.config import GLOBAL, SLIDING
    from dgemma.engine.kv.paged_cache import PagedKVCache
    from dgemma.kernels import (
        gpu,
        triton_attention,
        triton_layer,
        triton_quant,
        triton_step,
    )
    from dgemma.model.checkpoint import make_config
    from dgemma.model.diffusion_gemma import Attention, Experts
    from dgemma.model.presets import PRESETS
    from dgemma.quant.formats import DEFAULT_GROUP_SIZE, SCHEMES, quantize

    for module in (triton_layer, triton_attention, triton_quant, triton_step):
        module.available = lambda device: True  # meta tensors stand in for CUDA ones
    triton_attention._sm_count = lambda index: H200_SMS
    pick_splits = triton_attention.pick_splits
    triton_attention.pick_splits = lambda device, *a: pick_splits(torch.device("cuda", 0), *a)  # as on an H200
    modules = (triton_step, triton_layer, triton_attention, triton_quant)
    for fn in [getattr(m, name) for m in modules for name in dir(m) if name.endswith("_kernel")]:
        launches.capture(fn)

    cfg = make_config(**PRESETS["real"])
    dt, meta, c = torch.bfloat16, torch.device("meta"), cfg.canvas_length
    h, v = cfg.hidden_size, cfg.vocab_size

    def empty(*shape, dtype=dt):
        return torch.empty(*shape, dtype=dtype, device=meta)

    # the decoder step's sampler on n canvases (runner.decoder_step, runner._sample)
    for n in (1, 4):
        rows = n * c
        raw, temps = empty(rows, v), empty(rows, 1, dtype=torch.float32)
        for masked in (False, True):
            launches.label = f"step_statistics n={n}" + (" masked" if masked else "")
            allowed = empty(rows, -(-v // 32), dtype=torch.int32) if masked else None
            _, _, total, probs = triton_step.step_statistics(raw, temps, cfg.final_logit_softcapping, allowed, dt)
        launches.label = f"philox_draws + sample_rows n={n}"
        uniforms, _ = triton_step.philox_draws(empty(n, dtype=torch.long), empty(n, dtype=torch.long), c, v)
        triton_step.sample_rows(probs, total, uniforms.view(-1))

    # attention per layer kind (gpu.TritonAttention: norm_rope on q, k, v, then the paged canvas
    # kernel through the pass) on n canvases, block tables as wide as a CUDA graph's and a short one
    block = c  # EngineOptions' default block size: the canvas length
    cache = PagedKVCache(cfg, {SLIDING: 8, GLOBAL: 8}, block, meta, dt)
    for kind in (SLIDING, GLOBAL):
        layer = next(i for i, s in enumerate(cfg.layers) if s.kind == kind)
        d = cfg.layers[layer].head_dim
        with torch.device(meta):
            attn = gpu.TritonAttention(Attention(cfg, cfg.layers[layer]).to(dt))
        for n in (1, 2, 3, 4):
            for width in (-(-cfg.max_position_embeddings // block), 3):
                launches.label = f"{kind} n={n} width={width}"
                attn(empty(n, c, h), empty(n, c, d), empty(n, c, d), layer, cache.canvas_buffers(n, c, width))

    # the MoE block (gpu.TritonExperts: moe_experts -> gelu_mul, combine_topk), and gelu_mul at
    # the dense MLP's width
    with torch.device(meta):
        experts = gpu.TritonExperts(Experts(cfg).to(dt))
    for tokens in (c, 4 * c, 1):
        launches.label = f"moe_experts {tokens} tokens"
        index = empty(tokens, cfg.top_k_experts, dtype=torch.long)
        experts(empty(tokens, h), index, empty(tokens, cfg.top_k_experts, dtype=torch.float32))
        launches.label = f"gelu_mul dense MLP {tokens} tokens"
        triton_layer.gelu_mul(empty(tokens, 2 * cfg.intermediate_size))

    # quantised weights of every scheme (QuantLinear -> quant_linear, QuantExperts ->
    # quant_grouped_linear), rows from a short prefill chunk to batches of canvases. (On an H200,
    # fp8 goes to torch._scaled_mm / _scaled_grouped_mm instead: its kernel serves older GPUs.)
    s_spec, g_spec = (next(s for s in cfg.layers if s.kind == k) for k in (SLIDING, GLOBAL))
    linears = {  # [out, in] of quant/modules.LINEAR_TARGETS
        "sliding q": (cfg.num_heads * s_spec.head_dim, h), "sliding k/v": (s_spec.num_kv_heads * s_spec.head_dim, h),
        "sliding o": (h, cfg.num_heads * s_spec.head_dim), "global q": (cfg.num_heads * g_spec.head_dim, h),
        "global k": (g_spec.num_kv_heads * g_spec.head_dim, h), "global o": (h, cfg.num_heads * g_spec.head_dim),
        "mlp gate/up": (cfg.intermediate_size, h), "mlp down": (h, cfg.intermediate_size),
    }  # fmt: skip
    e, i, k = cfg.num_experts, cfg.moe_intermediate_size, cfg.top_k_experts
    for scheme in SCHEMES:
        for name, shape in linears.items():
            q = quantize(empty(*shape, dtype=torch.float32), scheme, DEFAULT_GROUP_SIZE, dt)
            for tokens in (c, 16, 32, 64):
                launches.label = f"{scheme} {name} M={tokens}"
                triton_quant.quant_linear(empty(tokens, shape[1]), q)
        for name, shape in (("experts gate_up", (e, 2 * i, h)), ("experts down", (e, h, i))):
            q = quantize(empty(*shape, dtype=torch.float32), scheme, DEFAULT_GROUP_SIZE, dt)
            for tokens in (c, 2 * c, 4 * c, 8 * c):  # rows per expert ~ tokens * top_k / experts
                launches.label = f"{scheme} {name} {tokens} tokens"
                triton_quant.quant_grouped_linear(empty(tokens * k, shape[2]), q, empty(e, dtype=torch.int32))


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
                found[index] = dict(json.load(f), cached=True)
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
    launches = Launches(GPUTarget("cuda", 90, 32), exact="--all" in argv)
    _launch_released(launches)
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
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main(sys.argv[1:]))
