"""Every Triton kernel variant the released model's shapes launch (google/diffusiongemma-26B-A4B-it,
presets.PRESETS["real"], bf16, fp8, int4, nvfp4) compiles for sm90 (H100 / H200) without a GPU: no
register spills, shared memory within a Hopper block's 227 KiB, registers that let a block launch,
tensor-core instructions in the matmuls; and the quantised GEMMs stream their packed weights.

The Triton interpreter runs Python, so it accepts kernels the GPU compiler refuses or compiles
badly; these compile to a cubin with triton's bundled ptxas instead (tests/kernels/triton_compile.py): the
launches are captured from whole engine steps at the released size on the meta device
(tests/launch_count.py's driver, an H200's choices) plus the wrappers the steps do not reach, so
the block sizes, warps, stages and split counts compiled are the ones the picking functions choose.
One subprocess compiles every variant (without TRITON_INTERPRET, which conftest sets for this
process); each compile's report is kept in pytest's cache under triton's own cache key, so a rerun
compiles only what changed. Skipped where triton lacks the ahead-of-time compile API.

The 4-bit GEMMs' K loop (the PTX's innermost loop holding tensor-core instructions) is read for
what the GPU issue asks of it: every global load at least 8 bytes, at most 1.25x the bytes the
K-tile holds for a thread (packed weights, their scales, the activations: no byte fetched twice),
tensor-core MMA. The fp8 GEMM, the sm80 (Ampere) fallback of FP8 on Hopper, is held to the same
compiled for sm80, where it decodes e4m3 by bits (triton has no float8e4nv before sm89).

Budgets (issue 54), from the SASS of every weight-streaming GEMM variant (nvdisasm from the triton
wheel, `triton_compile.sass_report`) at the released shapes: K-loop SASS instructions x num_warps
/ weight bytes a K step at most 0.25 for 1-byte (and 2-byte) weights and 0.5 for 4-bit (packed
bytes): an H200's SM receives ~18 bytes and issues 4 warp-instructions a clock, so above ~0.22 a
GEMM is bound by instructions, not memory; MMA issued at the tile's minimum, with at most
BLOCK_M / 16 warps along M; and at batch 1 every GEMM launches at least 132 CTAs (an H200's SMs;
no GEMM splits K). Pinned to triton 3.9.0 (pyproject's test extras) so that a release does not
move them; skipped, saying why, where triton lacks the ahead-of-time API.

W8A8 (issue 54, item 2: fp8 weights times activations quantised per token, kernels/triton_quant.py's
A8): every such variant an fp8 step launches (the dense linears, gate|up with gelu * up, the
experts' gate|up) multiplies e4m3 by e4m3 on the tensor cores (QGMMA ...E4M3.E4M3: fp8 wgmma; no
HMMA, which is what triton's mma.sync makes of e4m3 on sm90), within the same budgets; sm80 never
gets one (weight-only fp8 there)."""

import pytest

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
# every test reads the one compile of all variants (a subprocess, minutes on 2 cores the first
# time, cached after): the whole file is slow
pytestmark = [pytest.mark.triton, pytest.mark.subprocess, pytest.mark.slow]

from triton_compile import (  # noqa: E402
    H200_SMS,
    HOPPER_SHARED,
    REGISTERS_PER_SM,
    k_loop_metric,
    kernel_modules,
    mma_issued_and_minimum,
    released_variants,
    table,
)

MATMULS = ("_paged_canvas_kernel", "_gemm_kernel", "_router_kernel", "_router_chunks_kernel", "_paged_prefix_kernel")
EXPERTS = 128  # the released model's


@pytest.fixture(scope="module")
def reports(request):
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider: compile everything
    return cache.mkdir("triton_sm_reports") if cache is not None else None


@pytest.fixture(scope="module")
def variants(tmp_path_factory, reports):
    return released_variants(tmp_path_factory.mktemp("triton_cache"), reports, sass=True)


def of(variants, kernel):
    return [v for v in variants if v["kernel"] == kernel]


def test_every_kernel_is_compiled_at_the_picked_variants(variants):
    print("\n" + table(variants, uses=False))  # pytest -s: the table
    kernels = {n for m in kernel_modules() for n in dir(m) if n.endswith("_kernel")}
    assert {v["kernel"] for v in variants} == kernels
    norm = {
        (v["constexprs"]["HALF"], v["constexprs"]["HAS_WEIGHT"], v["constexprs"]["HAS_ROPE"])
        for v in of(variants, "_norm_rope_kernel")
    }
    assert norm == {
        (half, w, w) for half in (128, 256) for w in (True, False)
    }  # the unfused path: q / k normed and rotated, v normed
    assert {v["constexprs"]["HALF"] for v in of(variants, "_qkv_kernel")} == {128, 256}
    assert {v["constexprs"]["HAS_POOL"] for v in of(variants, "_qkv_kernel")} >= {False}

    # attention: both head dims; at batch 1 the prefix splits (and the splits' combine)
    splits = {}
    for v in of(variants, "_paged_canvas_kernel"):
        splits.setdefault(v["constexprs"]["D"], set()).add(v["constexprs"]["NUM_SPLITS"])
    assert set(splits) == {256, 512} and all(max(counts) > 1 for counts in splits.values()), splits
    combined = {(v["constexprs"]["D"], v["constexprs"]["NUM_SPLITS"]) for v in of(variants, "_combine_splits_kernel")}
    assert combined == {(d, s) for d, counts in splits.items() for s in counts if s > 1}

    # the GEMM: every weight format, grouped (gate|up with gelu * up, down scattered) and plain
    gemms = {
        (v["constexprs"]["SCHEME"], v["constexprs"]["GROUPED"], v["constexprs"]["DUAL"])
        for v in of(variants, "_gemm_kernel")
    }
    for scheme in (0, 2, 3, 4):  # int4, fp8, nvfp4 in every role; bf16 experts (bf16 linears: cuBLAS)
        assert {(scheme, True, True), (scheme, True, False)} <= gemms, scheme
    assert {(s, False, False) for s in (0, 1, 2, 3)} <= gemms
    w8a8 = {
        (v["constexprs"]["GROUPED"], v["constexprs"]["DUAL"])
        for v in of(variants, "_gemm_kernel")
        if v["constexprs"]["A8"]
    }
    assert w8a8 == {(False, False), (False, True), (True, True)}  # linears, dense gate|up, experts' gate|up
    assert of(variants, "_quantize_rows_kernel")


def test_no_variant_spills_registers(variants):
    spilled = [v for v in variants if v["spill_stores"] or v["spill_loads"]]
    assert not spilled, "register spills (ptxas -v, sm_90a):\n" + table(spilled)


def test_shared_memory_fits_a_hopper_block(variants):
    over = [v for v in variants if v["shared"] > HOPPER_SHARED]
    assert not over, f"more than {HOPPER_SHARED} bytes of shared memory:\n" + table(over)


def test_registers_let_a_block_launch(variants):
    over = [v for v in variants if v["registers"] > 255 or v["registers"] * 32 * v["num_warps"] > REGISTERS_PER_SM]
    assert not over, table(over)


def test_matmuls_use_tensor_cores(variants):
    scalar = [v for v in variants if v["kernel"] in MATMULS and not v["tensor_cores"]]
    assert not scalar, "tl.dot compiled without (wg)mma:\n" + table(scalar)


def tile_bytes(v: dict) -> int:
    """Bytes one K-tile of a GEMM variant holds: its packed weight rows (twice for gate and up),
    their scales, and the activations' rows."""
    c = v["constexprs"]
    bm, bn, bk, scheme = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["SCHEME"]
    weights = bn * bk // 2 if scheme in (0, 3) else bn * bk * (1 if scheme in (1, 2) else 2)
    scales = bn * bk // c["GROUP"] * c["SCALE_BYTES"] if scheme in (0, 3) else 0
    return (weights + scales) * (2 if c["DUAL"] else 1) + bm * bk * 2


def streams(v: dict) -> str | None:
    """What the variant's K loop does that it should not (None: nothing)."""
    loop = v.get("k_loop")
    if loop is None or not loop["mma"]:
        return "no K loop with tensor-core instructions"
    if loop["smallest"] < 8:
        return f"a {loop['smallest']}-byte load in the K loop"
    share = tile_bytes(v) / (32 * v["num_warps"])
    if loop["bytes"] > 1.25 * share:
        return (
            f"{loop['bytes']} bytes requested a thread a K step, {loop['bytes'] / share:.2f}x its share ({share:.0f})"
        )
    return None


def test_four_bit_gemms_stream_their_packed_weights(variants):
    """int4 and nvfp4, every variant the released model launches: whole-vector loads, each byte of
    the K-tile fetched once, tensor cores. (The kernel before this one loaded the weight a byte at a
    time, 128 loads a thread a K step for 36 useful bytes.)"""
    four_bit = [v for v in of(variants, "_gemm_kernel") if v["constexprs"]["SCHEME"] in (0, 3)]
    assert len(four_bit) >= 8
    bad = {id(v): streams(v) for v in four_bit if streams(v)}
    assert not bad, "\n".join(f"{reason}: " + table([v]) for v in four_bit if (reason := bad.get(id(v))))


SCHEMES = {0: "int4", 1: "int8", 2: "fp8", 3: "nvfp4", 4: "bf16"}
METRIC_BUDGET = {0: 0.5, 3: 0.5, 1: 0.25, 2: 0.25, 4: 0.25}  # 4-bit: a packed byte holds two weights


def gemm_table(rows: list[tuple[dict, str]]) -> str:
    """GEMM variants with what their budgets read, for a failing assert."""
    out = []
    for v, why in rows:
        c = v["constexprs"]
        issued, minimum = mma_issued_and_minimum(v)
        out.append(
            f"{why}: {SCHEMES[c['SCHEME']]} {'grouped ' if c['GROUPED'] else ''}{'dual ' if c['DUAL'] else ''}"
            f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} warps {v['num_warps']} "
            f"{v['sass']['mma_layouts'][0]['warps']}: metric {k_loop_metric(v):.3f}, MMA {issued} / {minimum}, "
            f"K loop {v['sass']['k_loop']['instructions']} SASS; used by {'; '.join(v['used_by'])}"
        )
    return "\n".join(out)


def test_gemm_k_loops_stay_within_the_instruction_budget(variants):
    """Every weight-streaming GEMM variant the released model launches (every format, the experts'
    and the linears', batch 1 and 4, an encode, an AR token, a turbo pass, short and long prefill
    chunks): K-loop SASS x num_warps / weight bytes a K step at most 0.25 (1- and 2-byte weights)
    or 0.5 (4-bit, packed bytes). Before issue 54's fixes fp8's gate|up was at 2.8 (its e4m3 bytes
    decoded by bit arithmetic, its warps laid [4, 1] over two MMA rows), nvfp4's at 2.2, int4's 1.5."""
    gemms = of(variants, "_gemm_kernel")
    assert {v["constexprs"]["SCHEME"] for v in gemms} == set(SCHEMES)
    over = [(v, "over budget") for v in gemms if k_loop_metric(v) > METRIC_BUDGET[v["constexprs"]["SCHEME"]]]
    print("\n" + gemm_table([(v, "variant") for v in gemms]))  # pytest -s: every variant's figures
    assert not over, gemm_table(over)


def test_gemm_mma_is_issued_at_the_tiles_minimum(variants):
    """No wasted warps: every GEMM variant's K loop issues the MMA its tile needs and no more (before,
    8 warps laid [8, 1] over bf16 gate|up's 32-row tile issued 4x the minimum, fp8's 2x), with at
    most BLOCK_M / 16 warps along M (mma.sync's 16 rows; wgmma's warpgroups 64 rows each)."""
    bad = []
    for v in of(variants, "_gemm_kernel"):
        issued, minimum = mma_issued_and_minimum(v)
        along_m = v["sass"]["mma_layouts"][0]["warps"][0]
        if issued != minimum or along_m > v["constexprs"]["BLOCK_M"] // 16:
            bad.append((v, "MMA not at the minimum"))
    assert not bad, gemm_table(bad)


def test_the_fast_decoders_are_the_ones_compiled(variants):
    """sm90: fp8 weights and nvfp4's e4m3 scales converted by the hardware (FP8_CVT), int4 / nvfp4
    codes decoded in the activations' 16 bits (FAST4): the paths the budgets hold."""
    for v in of(variants, "_gemm_kernel"):
        c = v["constexprs"]
        assert c["FP8_CVT"] == (c["SCHEME"] in (2, 3)), table([v])
        assert c["FAST4"] == (c["SCHEME"] in (0, 3)), table([v])


def test_w8a8_gemms_multiply_e4m3_on_the_tensor_cores(variants):
    """Every W8A8 variant (A8: an fp8 step's and an fp8 encode's): fp8 pointers straight into fp8
    wgmma (QGMMA ...E4M3.E4M3, K 32 an instruction), no other MMA in its K loop; the activations'
    quantisation (`_quantize_rows_kernel` and the row kernels' QUANT) compiled with the hardware's
    e4m3 conversion."""
    a8 = [v for v in of(variants, "_gemm_kernel") if v["constexprs"]["A8"]]
    assert a8 and all(all("fp8" in u for u in v["used_by"]) for v in a8), table(a8)  # fp8 models' only
    bad = [
        (v, "not fp8 wgmma")
        for v in a8
        if not v["constexprs"]["FP8_CVT"]
        or v["pointers"]["x_ptr"] != "*fp8e4nv"
        or not all(op.startswith("QGMMA.") and op.endswith(".E4M3.E4M3") for op in v["sass"]["k_loop"]["mma_ops"])
    ]
    assert not bad, gemm_table(bad)
    quant = [v for v in variants if v["constexprs"].get("QUANT") or v["kernel"] == "_quantize_rows_kernel"]
    assert quant and all(v["constexprs"]["FP8_CVT"] for v in quant), table(quant)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4", "nvfp4"])
def test_at_batch_1_every_gemm_launches_a_cta_an_sm(variants, fmt):
    """A batch-1 decoder step (one 256-position canvas): every weight-streaming GEMM launches at
    least 132 CTAs (an H200's SMs; none splits K). The experts' grid has one program column per
    expert (it walks its own rows, decoding each weight tile once a row tile); a quantised linear
    at M = 256 is split over rows (one row tile a program, its MMA inside the K loop) and columns
    (before, one program walked both 128-row tiles of the canvas, decoding each weight tile twice,
    on grids of [1, 128] and [1, 44])."""
    label = f"step {fmt} batch 1"
    launches = [(v, g) for v in of(variants, "_gemm_kernel") for g in v["grids"].get(label, [])]
    assert launches, label
    few = [(v, g) for v, g in launches if g[0] * g[1] < H200_SMS]
    assert not few, "\n".join(f"grid {g}: " + table([v]) for v, g in few)
    grouped = [g for v, g in launches if v["constexprs"]["GROUPED"]]
    assert grouped and all(g[0] == EXPERTS for g in grouped), grouped
    if fmt != "bf16":  # bf16 linears are cuBLAS's
        assert any(not v["constexprs"]["GROUPED"] and g[0] > 1 for v, g in launches), launches


@pytest.fixture(scope="module")
def sm80_fp8(tmp_path_factory, reports):
    return released_variants(
        tmp_path_factory.mktemp("triton_cache_sm80"), reports, arch=80, only="_gemm_kernel:SCHEME=2"
    )


def test_the_fp8_gemm_streams_its_weights_on_ampere_too(sm80_fp8):
    """FP8 weights on an A100 (no FP8 tensor cores): the same kernel, compiled for sm80 with the e4m3
    bytes decoded by bits (triton has no float8e4nv before sm89), holds to the 4-bit GEMMs' rules
    (vector loads, each byte once, mma) and neither spills nor overflows."""
    assert sm80_fp8 and all(v["arch"] == 80 for v in sm80_fp8)
    assert not any(v["constexprs"]["FP8_CVT"] or v["constexprs"]["A8"] for v in sm80_fp8)  # weight-only fp8
    bad = [v for v in sm80_fp8 if streams(v) or v["spill_stores"] or v["shared"] > 164 * 1024]
    assert not bad, "\n".join(f"{streams(v)}: " + table([v]) for v in bad)
