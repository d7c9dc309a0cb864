"""A roofline of every GPU launch of a step, PREDICTED on a CPU from the sm90 compile (no GPU).

Why: the fused GPU path's time can be read from its compiled code before a GPU is lent, and the
prediction is what a kernel change must move (issue 54's "before" and "after"). Nothing here is a
measurement: every time printed is labelled "predicted"; `scripts/gpu_check.py` measures.

What it does, for each scenario (a decoder step of bf16, fp8, int4 or nvfp4 weights at batch 1 and
8 after 512-token prompts; an AR token after a 512-token prompt; the encode of a 512-token prompt
and of a 16,384-token one, chunked as the scheduler chunks it: scripts/roofline_encode.py), at the
released model's shapes (presets "real") on the meta device with an H200's choices:

1. Every launch the step makes is recorded with its arguments (tests/launch_count.py's drivers and
   counting rules, tests/kernels/triton_compile.py's capture of Triton launches): Triton kernels
   with their grid and compile variant, torch operations (cuBLAS GEMMs: `F.linear` of bf16 weights,
   `torch.addmm` for probs @ E; copies, casts, ...) with their shapes.
2. Each Triton variant is compiled for sm90 (`triton_compile.compile_all`, reports cached by
   triton's own key under --reports) and its SASS read (nvdisasm from the triton wheel) and TTGIR:
   the K loop's instructions and MMA instructions, the warps and the MMA layout.
3. Each launch gets bytes moved (compulsory DRAM traffic: weights of the experts a step hits, the
   prefix's keys and values, activations), FLOPs, CTAs and waves on 132 SMs, and for the
   weight-streaming GEMMs the metric of issue 54, K-loop SASS instructions x num_warps / weight
   bytes a K step (packed bytes for 4-bit; above about ISSUE / (HBM bytes an SM a clock), ~0.22,
   a GEMM is bound by instruction issue, not memory), MMA issued against the tile's minimum, and
   the K loop's shared-memory bytes (ldmatrix, LDS / STS, cp.async, wgmma's shared operands).
4. predicted time of a launch = max(LAUNCH_FLOOR_S, max(bytes / HBM, warp-instructions / issue rate,
   shared bytes / shared bandwidth, tensor FLOPs / tensor peak) / wave efficiency); of a step, the
   sum. The shared-memory term and the floor go beyond issue 54's three terms: the issue's own
   reading of bf16's gate|up (80 KB of shared memory a K step for 12 KB of operands) is a shared
   bound; the floor is an assumption. cuBLAS and torch's own kernels have no compile to read: bytes
   and FLOPs only, wave efficiency 1.

    python scripts/roofline.py [--scheme bf16,fp8,int4,nvfp4] [--batch 1,8] [--kind step,ar,encode]
                               [--prompt 512,16384] [--json] [--fast] [--top 12] [--reports DIR]

`--fast` skips the compile (no instruction term, metric or MMA columns: bytes and FLOPs only; a few
seconds, for the suite). Needs triton's ahead-of-time API (exit 3 with the reason where it lacks it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

# ----------------------------------------------------------------------------- the H200, in one place
SMS = 132  # streaming multiprocessors of an H200 SXM (GH100 as in the H100 SXM5: NVIDIA Hopper whitepaper)
HBM_BYTES_PER_S = 4.3e12  # copy bandwidth measured on the lent H200 (docs/performance.md, 2026-12-04); datasheet 4.8e12
CLOCK_HZ = 1.83e9  # the SM clock NVIDIA quotes tensor peaks at: 989.4e12 = 132 SMs x 4096 bf16 FLOP a clock x 1.83e9
ISSUE_PER_SM_CLOCK = 4  # warp-instructions an SM issues a clock at most: 4 schedulers, 1 each (Hopper whitepaper)
ISSUE_PER_S = SMS * ISSUE_PER_SM_CLOCK * CLOCK_HZ  # 9.7e11 warp-instructions a second
TENSOR_BF16_FLOPS = 989.4e12  # dense bf16 / fp16 tensor-core peak (H100 / H200 SXM datasheet; 1,979 with sparsity)
TENSOR_FP8_FLOPS = 1978.9e12  # dense fp8 (datasheet): the W8A8 GEMMs (fp8 weights x fp8 activations, A8)
SHARED_BYTES_PER_SM_CLOCK = 128  # shared memory an SM reads or writes a clock (NVIDIA A100 / H100 whitepapers)
SHARED_BYTES_PER_S = SMS * SHARED_BYTES_PER_SM_CLOCK * CLOCK_HZ  # 3.1e13
LAUNCH_FLOOR_S = 2e-6  # assumption: a kernel in a CUDA graph takes at least ~2 us (launch and first CTAs' ramp)
HBM_BYTES_PER_SM_CLOCK = HBM_BYTES_PER_S / SMS / CLOCK_HZ  # ~17.8: what one SM receives a clock
ISSUE_BOUND_METRIC = ISSUE_PER_SM_CLOCK / HBM_BYTES_PER_SM_CLOCK  # ~0.22: above it a GEMM is issue-bound

CONSTANTS = {
    "sms": (SMS, "H200 SXM SMs (NVIDIA Hopper whitepaper, GH100 SXM5)"),
    "hbm_bytes_per_s": (HBM_BYTES_PER_S, "copy bandwidth measured on the lent H200, 2026-12-04 (datasheet: 4.8e12)"),
    "clock_hz": (CLOCK_HZ, "SM clock of NVIDIA's tensor peaks (989.4e12 = 132 x 4096 x 1.83e9)"),
    "issue_per_sm_clock": (
        ISSUE_PER_SM_CLOCK,
        "warp-instructions an SM issues a clock (4 schedulers, Hopper whitepaper)",
    ),
    "shared_bytes_per_sm_clock": (SHARED_BYTES_PER_SM_CLOCK, "shared memory bandwidth an SM (A100 / H100 whitepapers)"),
    "tensor_bf16_flops": (TENSOR_BF16_FLOPS, "dense bf16 tensor peak, H100/H200 SXM datasheet"),
    "tensor_fp8_flops": (TENSOR_FP8_FLOPS, "dense fp8 tensor peak, datasheet (the W8A8 GEMMs: e4m3 x e4m3)"),
    "launch_floor_s": (LAUNCH_FLOOR_S, "assumption: the least a kernel takes in a CUDA graph"),
}

# issue 54's targets (a step at batch 1, canvas 256, prefix 512, on an H200; AR: a token) and the
# figures measured before the fused path (docs/performance.md, "On an H200: before")
TARGETS_MS = {("step", "bf16", 1): 17.0, ("step", "fp8", 1): 9.0, ("step", "int4", 1): 7.0, ("step", "nvfp4", 1): 7.0}
TARGETS_MS[("ar", "bf16", 1)] = 3.0
MEASURED_BEFORE_MS = {("step", "bf16", 1): 32.1, ("step", "fp8", 1): 36.8, ("step", "nvfp4", 1): 577.0}
MEASURED_BEFORE_MS[("ar", "bf16", 1)] = 62.0

SCHEMES = ("bf16", "fp8", "int4", "nvfp4")
KINDS = ("step", "ar", "encode")
PROMPT = 512  # the prompt before the measured step (the issue's prefix) and the encoded chunk's length
ENCODE_PROMPTS = (PROMPT, 16384)  # the encodes: one short chunk; a long prompt, 8 of the engine's 2,048-token chunks
GEMM = "_gemm_kernel"
FOUR_BIT = (0, 3)  # _gemm_kernel's SCHEME constant of int4 and nvfp4 (packed: half a byte a weight)
LIBRARY_OPS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm"}


@dataclass
class Scenario:
    """What is predicted: a decoder step of `batch` canvases, an AR token, or a `prompt`-token
    prompt's encode (every chunk of it)."""

    kind: str  # step, ar, encode
    scheme: str
    batch: int = 1
    prompt: int = PROMPT

    @property
    def name(self) -> str:
        if self.kind == "encode":
            return f"encode {self.scheme} {self.prompt} tokens"
        return f"{'AR token' if self.kind == 'ar' else 'step'} {self.scheme} batch {self.batch}"

    @property
    def prefix(self) -> int:
        """Committed positions each row's attention reads: the prompt (an AR token: and itself)."""
        return {"step": PROMPT, "ar": PROMPT + 1, "encode": 0}[self.kind]


@dataclass
class Cost:
    """One launch's roofline inputs and its predicted time (seconds)."""

    kernel: str  # a Triton kernel's name, "cuBLAS mm", "torch copy_", "host read"
    role: str  # what it computes (e.g. "experts gate|up", "LM head")
    region: str
    count: int = 1  # GPU kernels the launch is (torch's multi-kernel ops)
    bytes: float = 0.0
    flops: float = 0.0  # on tensor cores (GEMMs, attention)
    ctas: int | None = None
    active_ctas: int | None = None  # CTAs with work (an expert no token routes to returns at once)
    warp_instructions: float | None = None  # K loops only (weight-streaming GEMMs)
    shared_bytes: float | None = None  # shared memory the K loops read and write (LDSM, LDS, cp.async, wgmma operands)
    metric: float | None = None  # K-loop SASS x num_warps / weight bytes a K step
    k_loop_instructions: int | None = None  # SASS instructions of one K step, per warp
    step_weight_bytes: float | None = None  # weight bytes a CTA's K step reads (packed for 4-bit)
    mma_issued: int | None = None  # MMA instructions a K step a CTA (warpgroup ops for wgmma)
    mma_minimum: int | None = None  # ... the tile needs at the compiled instruction shape
    warps: int | None = None  # num_warps (TTGIR)
    mma_warps: list | None = None  # the MMA layout's warpsPerCTA
    fp8_mma: bool = False  # e4m3 x e4m3 on the tensor cores (a W8A8 GEMM): FLOPs at the fp8 peak
    variant: str | None = None
    terms: dict = field(default_factory=dict)

    @property
    def waves(self) -> float | None:
        return None if self.active_ctas is None else self.active_ctas / SMS

    @property
    def wave_efficiency(self) -> float:
        """Share of the SMs' time a launch's waves keep busy (one CTA an SM a wave): 1 for library
        kernels, whose grids are not known here."""
        if not self.active_ctas:
            return 1.0
        return self.active_ctas / (math.ceil(self.active_ctas / SMS) * SMS)

    def predict(self) -> float:
        """Seconds, PREDICTED: the largest term over the wave efficiency, at least the launch floor."""
        self.terms = {
            "memory": self.bytes / HBM_BYTES_PER_S,
            "issue": (self.warp_instructions or 0.0) / ISSUE_PER_S,
            "shared": (self.shared_bytes or 0.0) / SHARED_BYTES_PER_S,
            "tensor": self.flops / (TENSOR_FP8_FLOPS if self.fp8_mma else TENSOR_BF16_FLOPS),
        }
        roof = max(self.terms.values()) / self.wave_efficiency
        return max(LAUNCH_FLOOR_S * self.count, roof)

    @property
    def bound(self) -> str:
        """The term that sets the predicted time ("floor": none reaches the launch floor)."""
        t = self.predict()
        if t <= LAUNCH_FLOOR_S * self.count + 1e-15:
            return "floor"
        return max(self.terms, key=self.terms.get)

    def row(self) -> dict:
        return dict(asdict(self), predicted_s=self.predict(), bound=self.bound, waves=self.waves)


# ------------------------------------------------------------------------------------ recording
class Recorder:
    """Every launch of the counted region (launch_count's rules), with what the roofline reads:
    torch operations with their tensors (launch_count's counter, wrapped), Triton launches with
    their arguments, grid and compile variant (triton_compile.Launches.recorder)."""

    def __init__(self, lc):
        self.lc = lc
        self.records: list[dict] = []

    def triton(self, key, fn, args, kwargs, grid) -> None:
        """triton_compile.Launches.recorder: one Triton launch, kept where the count counts it."""
        if not self.lc._ACTIVE or self.lc._ACTIVE[-1].paused:
            return
        counter = self.lc._ACTIVE[-1]
        named = dict(zip(fn.arg_names, args))
        named.update(kwargs)
        self.records.append(
            dict(
                kind="triton",
                name=fn.__name__,
                module=fn.__module__.rsplit(".", 1)[-1],
                count=1,
                region=counter.region,
                launches=counter.launches,
                key=key,
                args=named,
                grid=grid,
            )
        )

    @contextlib.contextmanager
    def active(self):
        """Inside, launch_count's counter records each torch operation it counts, with its tensors."""
        counter_cls = self.lc._Counter
        note, dispatch = counter_cls.note, counter_cls.__torch_dispatch__
        records = self.records

        def noting(counter, name, count=1):
            note(counter, name, count)
            if not counter.paused and not name.startswith("triton:"):
                kind = "read" if name.startswith("d2h:") else "aten"
                records.append(
                    dict(kind=kind, name=name, count=count, region=counter.region, launches=counter.launches)
                )

        def dispatching(counter, func, types, args=(), kwargs=None):
            n = len(records)
            out = dispatch(counter, func, types, args, kwargs)
            for r in records[n:]:
                r.update(args=args, kwargs=kwargs or {}, out=out)
            return out

        counter_cls.note, counter_cls.__torch_dispatch__ = noting, dispatching
        try:
            yield self
        finally:
            counter_cls.note, counter_cls.__torch_dispatch__ = note, dispatch


def _helpers():
    """The test suite's helper modules this script drives (tests/ and tests/kernels/ on sys.path;
    scripts/ too, for roofline_encode)."""
    for path in (str(TESTS / "kernels"), str(TESTS), str(ROOT), str(ROOT / "scripts")):
        if path not in sys.path:
            sys.path.insert(0, path)
    import triton_compile

    import launch_count

    return launch_count, triton_compile


def capture(scenarios: list[Scenario], sass: bool = True):
    """(triton_compile.Launches holding every variant, {scenario name: launch records}, config)."""
    launch_count, triton_compile = _helpers()
    import roofline_encode
    from triton.backends.compiler import GPUTarget

    launches = triton_compile.Launches(GPUTarget("cuda", 90, 32), sass=sass)
    for module in triton_compile.kernel_modules():
        for name in dir(module):
            if name.endswith("_kernel"):
                launches.capture(getattr(module, name))
    recorder = Recorder(launch_count)
    launches.recorder = recorder.triton
    out: dict[str, list[dict]] = {}
    nets: dict[str, object] = {}
    config = None
    with recorder.active():
        for s in scenarios:
            if s.scheme not in nets:
                nets.clear()  # one released net at a time (meta: no data, but their modules add up)
                nets[s.scheme] = launch_count.released_net(None if s.scheme == "bf16" else s.scheme)
            net = nets[s.scheme]
            config = net.config
            launches.label = s.name
            if s.kind == "step":
                passes = [(None, launch_count.step_launches(net, s.batch))]
            elif s.kind == "ar":
                passes = [(None, launch_count.ar_token_launches(net, rows=s.batch))]
            else:  # a pass a prompt chunk, its records marked with where the chunk starts
                passes = roofline_encode.prompt_encode_launches(net, s.prompt)
            out[s.name] = [
                dict(r, start=start) for start, counted in passes for r in recorder.records if r["launches"] is counted
            ]
            recorder.records.clear()
    return launches, out, config


def compile_reports(launches, records: dict[str, list[dict]], reports: str | None) -> dict[str, dict]:
    """{variant key: its sm90 compile report with SASS} for the variants the records use."""
    import copy

    _, triton_compile = _helpers()
    used = {r["key"] for rs in records.values() for r in rs if r["kind"] == "triton"}
    sub = copy.copy(launches)
    sub.variants = {k: v for k, v in launches.variants.items() if k in used}
    return dict(zip(sub.variants, triton_compile.compile_all(sub, reports)))


# ------------------------------------------------------------------------------------ the model
def nbytes(t) -> int:
    """Bytes of a tensor view (numel x element size)."""
    return t.numel() * t.element_size()


def tensor_args(values) -> list:
    """The tensors among `values`, each object once."""
    import torch

    seen, out = set(), []
    for v in values:
        if isinstance(v, torch.Tensor) and id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def expected_experts(experts: int, top_k: int, tokens: int) -> float:
    """Experts at least one of `tokens` routes to, routing uniform: E (1 - (1 - k/E)^T)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def layer_specs(config) -> tuple:
    """(a sliding layer's LayerSpec, a global layer's): head dims and KV heads."""
    sliding = next((spec for spec in config.layers if spec.is_sliding), config.layers[0])
    full = next((spec for spec in config.layers if not spec.is_sliding), sliding)
    return sliding, full


def shape_roles(config) -> dict[tuple[int, int], str]:
    """Weight shapes (N out, K in) -> the matrix's name (a linear's, fused rows included)."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    hq = config.num_heads
    sliding, full = layer_specs(config)
    d, hkv, gd, ghkv = sliding.head_dim, sliding.num_kv_heads, full.head_dim, full.num_kv_heads
    return {
        ((hq + 2 * hkv) * d, h): "q|k|v sliding",
        ((hq + ghkv) * gd, h): "q|k global (V = K)",
        ((hq + 2 * ghkv) * gd, h): "q|k|v global",
        (h, hq * d): "o_proj sliding",
        (h, hq * gd): "o_proj global",
        (2 * i, h): "gate|up",
        (h, i): "down",
        (v, h): "LM head",
        (h, v): "probs @ E",
        (config.num_experts, h): "router",
    }


def _role(roles, n: int, k: int, region: str) -> str:
    name = roles.get((n, k), f"linear {k}->{n}")
    if name in ("gate|up", "down"):
        return ("dense " if region.startswith("layer") else "self-cond ") + name
    return name


def gemm_cost(rec: dict, report: dict | None, roles) -> Cost:
    """triton_quant._gemm_kernel: weights of the experts the step hits (or the linear's), the
    activations' rows, the output; the K loop's instructions from the SASS."""
    a, grid = rec["args"], rec["grid"]
    x, w, s, cs, y = a["x_ptr"], a["w_ptr"], a["s_ptr"], a["cs_ptr"], a["y_ptr"]
    rows, n, k = a["M"], a["N"], a["K"]
    scheme, dual, grouped, top_k = a["SCHEME"], a["DUAL"], a["GROUPED"], a["TOP_K"]
    bm, bn, bk = a["BLOCK_M"], a["BLOCK_N"], a["BLOCK_K"]
    n_w = n * (2 if dual else 1)
    weight_parts = [w] + [t for t in (s, cs) if t is not w]
    ctas = grid[0] * grid[1]
    if grouped:
        experts = w.shape[0]
        tokens = rows // top_k if a["GATHER"] else rows
        hit = expected_experts(experts, top_k, rows // top_k)
        weights = hit * sum(nbytes(t) for t in weight_parts) / experts
        x_bytes = tokens * k * x.element_size()
        active = round(hit * grid[1])
        tiles = max(1, math.ceil(rows / hit / bm))
        role = "experts gate|up" if dual else "experts down"
    else:
        weights = sum(nbytes(t) for t in weight_parts)
        x_bytes = rows * k * x.element_size()
        active = ctas
        tiles = 1  # a program one row tile (the grid split over rows)
        role = _role(roles, n_w, k, rec["region"])
    index = nbytes(a["pairs_ptr"]) if a["pairs_ptr"] is not y else 0
    a8 = bool(a.get("A8"))  # W8A8: x is e4m3 (1 byte an element, counted above), a float32 scale a row
    index += rows * 4 if a8 else 0
    cost = Cost(
        kernel=GEMM,
        role=role,
        region=rec["region"],
        bytes=weights + x_bytes + rows * n * y.element_size() + index,
        flops=2.0 * rows * n_w * k,
        ctas=ctas,
        active_ctas=active,
        variant=f"SCHEME={scheme} {'A8 ' if a8 else ''}{'grouped ' if grouped else ''}{'dual ' if dual else ''}"
        f"{bm}x{bn}x{bk}",
        fp8_mma=a8 and bool(a.get("FP8_CVT")),
    )
    per_weight = 0.5 if scheme in FOUR_BIT else w.element_size()
    cost.step_weight_bytes = (2 if dual else 1) * bn * bk * per_weight
    sass = (report or {}).get("sass")
    if sass:
        warps = sass["num_warps"]
        layout = sass["mma_layouts"][0] if sass["mma_layouts"] else None
        cost.warps, cost.mma_warps = warps, layout and layout["warps"]
        loop = sass["k_loop"]
        if loop:
            cost.k_loop_instructions = loop["instructions"]
            cost.metric = loop["instructions"] * warps / cost.step_weight_bytes
            steps = math.ceil(k / bk) * tiles * active  # K steps of all CTAs
            cost.warp_instructions = loop["instructions"] * warps * steps
            cost.shared_bytes = loop.get("shared_bytes", 0.0) * warps * steps
            if layout:
                wgmma = layout["version"] >= 3
                cost.mma_issued = loop["mma"] * warps // (4 if wgmma else 1)
                m_instr = 64 if wgmma else layout["instr"][0]
                n_instr = layout["instr"][1]
                width = (2 if dual else 1) * bn  # gate and up: one tile of 2 BLOCK_N weight rows, one MMA
                depth = layout["instr"][2] if len(layout["instr"]) > 2 else 32 if cost.fp8_mma else 16  # K an MMA
                cost.mma_minimum = math.ceil(bm / m_instr) * math.ceil(width / n_instr) * (bk // depth)
    return cost


def attention_cost(rec: dict, config, prefix: int) -> Cost:
    """triton_attention._paged_canvas_kernel: q, the prefix's keys and values (a sliding layer's
    window of them), the canvas's, the output (or the splits' float32 partials)."""
    a, grid = rec["args"], rec["grid"]
    q, kc, kp, vp = a["q_ptr"], a["kc_ptr"], a["kp_ptr"], a["vp_ptr"]
    n, h, rows, d = q.shape
    hkv, c = kc.shape[1], kc.shape[2]
    sliding = d == layer_specs(config)[0].head_dim
    keys = min(prefix, config.sliding_window) if sliding else prefix
    others = [t for t in tensor_args(a.values()) if t is not kp and t is not vp]
    cost = Cost(
        kernel=rec["name"],
        role=f"attention {'sliding' if sliding else 'global'}",
        region=rec["region"],
        bytes=sum(nbytes(t) for t in others) + n * hkv * keys * d * (kp.element_size() + vp.element_size()),
        flops=4.0 * n * h * rows * d * (keys + c),
        ctas=math.prod(grid),
        active_ctas=math.prod(grid),
        variant=f"D={d} splits={a['NUM_SPLITS']} {a['BLOCK_M']}x{a['BLOCK_N']}",
    )
    return cost


def triton_cost(rec: dict, report: dict | None, config, roles, prefix: int) -> Cost:
    """A Triton launch's cost: the GEMM and the attention modelled above; the others read and
    write their tensor arguments once (views: what they index), with the exceptions below."""
    name, a = rec["name"], rec["args"]
    if name == GEMM:
        return gemm_cost(rec, report, roles)
    if name == "_paged_canvas_kernel":
        cost = attention_cost(rec, config, prefix)
    elif name == "_paged_prefix_kernel":  # an encode's causal attention over the pool (roofline_encode)
        import roofline_encode

        work = roofline_encode.prefix_attention(rec, prefix)
        cost = Cost(
            kernel=name,
            role=f"attention {'sliding' if work['sliding'] else 'global'}",
            region=rec["region"],
            bytes=work["bytes"],
            flops=work["flops"],
            ctas=work["ctas"],
            active_ctas=work["ctas"],
            variant=work["variant"],
        )
    else:
        tensors = tensor_args(a.values())
        total = sum(nbytes(t) for t in tensors)
        role = name.strip("_").removesuffix("_kernel")
        if name == "_embed_norm_kernel" and a["FROM_IDS"]:  # the table's rows of the ids, not the table
            table = a["table_ptr"]
            total += a["T"] * table.shape[1] * table.element_size() - nbytes(table)
        if name in ("_qkv_kernel", "_norm_rope_kernel") and a["HAS_POOL"]:  # the rows written, not the pool
            pools = [t for t in tensor_args([a.get("kpool_ptr"), a.get("vpool_ptr"), a.get("pool_ptr")])]
            heads_total = a["HQ"] + 2 * a["HKV"] if name == "_qkv_kernel" else a["HEADS"]
            tokens = a["ROWS"] // heads_total
            written = a["HKV"] if name == "_qkv_kernel" else a["HEADS"]
            for pool in pools:
                total += tokens * written * 2 * a["HALF"] * pool.element_size() - nbytes(pool)
        if name in ("_qkv_kernel", "_combine_splits_kernel"):
            d = 2 * a["HALF"] if "HALF" in a else a["D"]
            role += " sliding" if d == layer_specs(config)[0].head_dim else " global"
        if rec["module"] == "triton_norms" and name == "_combine_kernel":
            role = "combine + norms"
        cost = Cost(kernel=name, role=role, region=rec["region"], bytes=total)
        cost.ctas = cost.active_ctas = math.prod(rec["grid"])
    sass = (report or {}).get("sass")
    if sass:
        cost.warps = sass["num_warps"]
        cost.mma_warps = sass["mma_layouts"][0]["warps"] if sass["mma_layouts"] else None
    return cost


def aten_cost(rec: dict, roles) -> Cost:
    """A torch operation: bytes of its inputs and outputs (views), an indexed copy only its rows;
    GEMMs' FLOPs. cuBLAS for the matmuls."""
    name = rec["name"]
    args, kwargs, out = rec.get("args", ()), rec.get("kwargs", {}), rec.get("out")
    ins = tensor_args(list(args) + list(kwargs.values()))
    outs = [t for t in tensor_args(out if isinstance(out, (tuple, list)) else [out]) if all(t is not i for i in ins)]
    flops, role = 0.0, name
    if name in ("index_select", "embedding", "gather"):  # the rows gathered (read, written) and the index
        moved = 2 * sum(nbytes(t) for t in outs) + sum(nbytes(t) for t in ins[1:] if not t.dtype.is_floating_point)
    elif name in ("index_copy_", "index_copy", "index_put_", "index_put", "_index_put_impl_", "scatter_", "scatter"):
        moved = 2 * sum(nbytes(t) for t in ins[1:])
    else:
        moved = sum(nbytes(t) for t in ins + outs)
    if name in ("mm", "addmm", "bmm", "baddbmm"):
        a, b = ins[-2], ins[-1]
        m, kk, n = a.shape[-2], a.shape[-1], b.shape[-1]
        batch = a.shape[0] if a.dim() == 3 else 1
        flops = 2.0 * batch * m * kk * n
        role = _role(roles, n, kk, rec["region"]) if a.dim() == 2 else f"bmm {batch}x{m}x{kk}x{n}"
    kernel = f"cuBLAS {name}" if name in LIBRARY_OPS else f"torch {name}"
    return Cost(kernel=kernel, role=role, region=rec["region"], count=rec["count"], bytes=moved, flops=flops)


def costs(records: list[dict], reports: dict[str, dict], config, prefix: int) -> list[Cost]:
    """Each recorded launch's Cost (a host read: the launch floor only); an encode's records carry
    their chunk's start, the attention's prefix."""
    roles = shape_roles(config)
    out = []
    for rec in records:
        if rec["kind"] == "triton":
            start = rec.get("start")
            out.append(triton_cost(rec, reports.get(rec["key"]), config, roles, prefix if start is None else start))
        elif rec["kind"] == "read":
            out.append(Cost(kernel="host read", role=rec["name"], region=rec["region"], count=rec["count"]))
        else:
            out.append(aten_cost(rec, roles))
    return out


def group(cs: list[Cost]) -> list[dict]:
    """Launches of one kernel and role summed (per launch: the largest grid), by predicted time."""
    rows: dict[tuple, dict] = {}
    for c in cs:
        r = c.row()
        g = rows.setdefault(
            (c.kernel, c.role),
            dict(
                r,
                launches=0,
                bytes=0.0,
                flops=0.0,
                predicted_s=0.0,
                warp_instructions=None,
                shared_bytes=None,
                variants=set(),
                slowest=0.0,
            ),
        )
        if r["predicted_s"] > g["slowest"]:  # the bound of the group's slowest launch
            g["slowest"], g["bound"] = r["predicted_s"], r["bound"]
        g["launches"] += c.count
        g["bytes"] += c.bytes
        g["flops"] += c.flops
        g["predicted_s"] += r["predicted_s"]
        for key in ("warp_instructions", "shared_bytes"):
            if getattr(c, key) is not None:
                g[key] = (g[key] or 0.0) + getattr(c, key)
        if c.variant:
            g["variants"].add(c.variant)
        for key in ("metric", "active_ctas", "ctas"):  # the worst launch
            if r[key] is not None and (g[key] is None or r[key] > g[key]):
                g[key] = r[key]
    out = sorted(rows.values(), key=lambda g: -g["predicted_s"])
    for g in out:
        g["variants"] = sorted(g["variants"])
        g["waves"] = None if g["active_ctas"] is None else g["active_ctas"] / SMS
        g.pop("terms", None)
        g.pop("slowest", None)
    return out


def summarise(s: Scenario, cs: list[Cost]) -> dict:
    """A scenario's predicted total, its target, and its kernels grouped (the JSON's entry)."""
    predicted = sum(c.predict() for c in cs)
    by_name: dict[str, float] = {}
    for c in cs:
        name = "cuBLAS" if c.kernel.startswith("cuBLAS") else "torch ops" if c.kernel.startswith("torch") else c.kernel
        by_name[name] = by_name.get(name, 0.0) + c.predict()
    key = (s.kind, s.scheme, s.batch)
    return dict(
        scenario=s.name,
        kind=s.kind,
        scheme=s.scheme,
        batch=s.batch,
        prefix=s.prefix,
        launches=sum(c.count for c in cs),
        bytes=sum(c.bytes for c in cs),
        flops=sum(c.flops for c in cs),
        predicted_ms=predicted * 1e3,
        bytes_ms=sum(c.bytes for c in cs) / HBM_BYTES_PER_S * 1e3,
        target_ms=TARGETS_MS.get(key),
        measured_before_ms=MEASURED_BEFORE_MS.get(key),
        predicted_us_by_kernel={k: v * 1e6 for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])},
        kernels=group(cs),
    )


# ------------------------------------------------------------------------------------ output
def _fmt(v, spec: str, empty: str = "-") -> str:
    return empty if v is None else format(v, spec)


def kernel_table(summary: dict, top: int) -> str:
    """The `top` kernel / role rows of a scenario (0: all), most predicted time first."""
    head = (
        f"  {'kernel':22s} {'role':22s} {'n':>4} {'MB':>9} {'GFLOP':>8} {'CTAs':>6} {'waves':>6} {'eff':>5} "
        f"{'metric':>6} {'MMA/min':>8} {'warps':>9} {'bound':>6} {'predicted us':>12} {'share':>6}"
    )
    lines = [head]
    total = summary["predicted_ms"] * 1e3
    shown = summary["kernels"][:top] if top else summary["kernels"]
    for g in shown:
        mma = f"{g['mma_issued'] / g['mma_minimum']:.1f}x" if g["mma_issued"] and g["mma_minimum"] else "-"
        warps = "-" if g["warps"] is None else f"{g['warps']}" + (f" {g['mma_warps']}" if g["mma_warps"] else "")
        eff = (
            "-" if g["active_ctas"] is None else f"{Cost('', '', '', active_ctas=g['active_ctas']).wave_efficiency:.2f}"
        )
        lines.append(
            f"  {g['kernel'][:22]:22s} {g['role'][:22]:22s} {g['launches']:4d} {g['bytes'] / 1e6:9.1f} "
            f"{g['flops'] / 1e9:8.1f} {_fmt(g['active_ctas'], 'd'):>6} {_fmt(g['waves'], '.2f'):>6} {eff:>5} "
            f"{_fmt(g['metric'], '.2f'):>6} {mma:>8} {warps:>9} {g['bound']:>6} {g['predicted_s'] * 1e6:12.1f} "
            f"{g['predicted_s'] * 1e6 / max(total, 1e-9):6.1%}"
        )
    rest = summary["kernels"][len(shown) :]
    if rest:
        lines.append(
            f"  ({len(rest)} more kernel/role rows, {sum(g['launches'] for g in rest)} launches: "
            f"{sum(g['predicted_s'] for g in rest) * 1e6:.1f} us predicted)"
        )
    return "\n".join(lines)


def step_line(summary: dict) -> str:
    """A scenario's predicted time beside its target and what was measured before."""
    target = f"target <= {summary['target_ms']:g} ms" if summary["target_ms"] else "no target"
    before = (
        f"; measured before the fused path {summary['measured_before_ms']:g} ms"
        if summary["measured_before_ms"]
        else ""
    )
    return (
        f"{summary['scenario']}: {summary['predicted_ms']:.2f} ms predicted ({target}{before}); "
        f"{summary['launches']} launches, {summary['bytes'] / 1e9:.2f} GB (bytes alone {summary['bytes_ms']:.2f} ms), "
        f"{summary['flops'] / 1e12:.2f} TFLOP"
    )


def text(result: dict, top: int) -> str:
    """The whole report as text (`run`'s result), every time labelled predicted."""
    out = [
        "Roofline on an H200, PREDICTED from the sm90 compile on a CPU (not measured)"
        + (" -- --fast: no compile, bytes and FLOPs only" if result["fast"] else ""),
        "constants (scripts/roofline.py, top):",
        *(f"  {k:26s} {v[0]:<10g} {v[1]}" for k, v in CONSTANTS.items()),
        f"predicted time of a launch = max({LAUNCH_FLOOR_S * 1e6:g} us, max(bytes / {HBM_BYTES_PER_S / 1e12:g} TB/s, "
        f"warp-instructions / {ISSUE_PER_S / 1e9:.0f} G/s, shared bytes / {SHARED_BYTES_PER_S / 1e12:.1f} TB/s, "
        f"FLOPs / {TENSOR_BF16_FLOPS / 1e12:g} TFLOP/s (W8A8: {TENSOR_FP8_FLOPS / 1e12:g})) / wave efficiency); "
        f"metric above {ISSUE_BOUND_METRIC:.2f}: a GEMM bound by issue",
        "",
    ]
    for summary in result["scenarios"]:
        out += [step_line(summary), kernel_table(summary, top), ""]
    out.append("summary (every figure predicted):")
    out.append(f"  {'scenario':28s} {'launches':>8} {'GB':>7} {'bytes ms':>9} {'predicted ms':>12} {'target ms':>10}")
    for summary in result["scenarios"]:
        out.append(
            f"  {summary['scenario']:28s} {summary['launches']:8d} {summary['bytes'] / 1e9:7.2f} "
            f"{summary['bytes_ms']:9.2f} {summary['predicted_ms']:12.2f} {_fmt(summary['target_ms'], 'g'):>10}"
        )
    return "\n".join(out)


def scenarios_from(
    schemes: list[str], batches: list[int], kinds: list[str], prompts: tuple[int, ...] = (PROMPT,)
) -> list[Scenario]:
    """The scenarios of the options, a scheme at a time (one released net built per scheme);
    `prompts`: the encodes' prompt lengths."""
    out = []
    for scheme in schemes:
        for kind in kinds:
            if kind == "step":
                out += [Scenario("step", scheme, b) for b in batches]
            elif kind == "ar":
                out.append(Scenario("ar", scheme, 1))
            else:
                out += [Scenario("encode", scheme, 1, prompt) for prompt in prompts]
    return out


def run(scenarios: list[Scenario], fast: bool = False, reports: str | None = None) -> dict:
    """The roofline of `scenarios` (fast: without the compile) as a JSON-able dict."""
    launches, records, config = capture(scenarios, sass=not fast)
    compiled = {} if fast else compile_reports(launches, records, reports)
    out = []
    for s in scenarios:
        out.append(summarise(s, costs(records[s.name], compiled, config, s.prefix)))
    constants = {k: v[0] for k, v in CONSTANTS.items()}
    return dict(predicted=True, fast=fast, constants=constants, scenarios=out)


def _aot_missing() -> str | None:
    """Why triton's ahead-of-time compile cannot run here (None: it can)."""
    try:
        import inspect

        from triton import knobs
        from triton.backends.nvidia.compiler import get_ptxas
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction

        assert {"constexprs", "attrs"} <= set(inspect.signature(ASTSource).parameters), "ASTSource(constexprs, attrs)"
        assert hasattr(JITFunction, "_pack_args"), "JITFunction._pack_args"
        assert os.path.exists(get_ptxas(90).path), "triton's bundled ptxas"
        assert os.path.exists(knobs.nvidia.nvdisasm.path), "triton's bundled nvdisasm"
    except Exception as e:  # noqa: BLE001
        return f"no ahead-of-time compile API here: {e!r}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scheme", default=",".join(SCHEMES), help="weights, comma separated (default: all four)")
    p.add_argument("--batch", default="1,8", help="a step's batch sizes, comma separated (default: 1,8)")
    p.add_argument("--kind", default=",".join(KINDS), help="step, ar (a token), encode (a prompt, chunk by chunk)")
    p.add_argument(
        "--prompt", default=",".join(map(str, ENCODE_PROMPTS)), help="the encodes' prompt lengths, comma separated"
    )
    p.add_argument("--json", action="store_true", help="one JSON object on stdout (scripts/gpu_check.py reads it)")
    p.add_argument("--fast", action="store_true", help="no sm90 compile: bytes, FLOPs and grids only (seconds)")
    p.add_argument("--top", type=int, default=12, help="kernel rows a scenario in the text (0: all)")
    p.add_argument("--reports", default=str(ROOT / ".cache" / "sm90_reports"), help="compile reports cache")
    args = p.parse_args(argv)
    schemes = [s for s in args.scheme.split(",") if s]
    kinds = [k for k in args.kind.split(",") if k]
    bad = sorted(set(schemes) - set(SCHEMES)) + sorted(set(kinds) - set(KINDS))
    if bad:
        p.error(f"unknown --scheme / --kind: {', '.join(bad)}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: the kernels would be built for the interpreter (run without it)")
        return 3
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the launchers' enable_fp_fusion=True; quiets 3.9
    why = _aot_missing()
    if why:
        print(why)
        return 3
    batches, prompts = [int(b) for b in args.batch.split(",")], tuple(int(n) for n in args.prompt.split(",") if n)
    result = run(scenarios_from(schemes, batches, kinds, prompts), args.fast, args.reports)
    if args.json:
        print(json.dumps(result))
    else:
        print(text(result, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
