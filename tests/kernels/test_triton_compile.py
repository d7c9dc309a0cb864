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
tensor-core MMA; and at batch 1 one row tile per expert or linear (the launch grids). The fp8
GEMM, the sm80 (Ampere) fallback of FP8 on Hopper, is held to the same compiled for sm80."""

import pytest

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
# every test reads the one compile of all variants (a subprocess, minutes on 2 cores the first
# time, cached after): the whole file is slow
pytestmark = [pytest.mark.triton, pytest.mark.subprocess, pytest.mark.slow]

from triton_compile import HOPPER_SHARED, REGISTERS_PER_SM, kernel_modules, released_variants, table  # noqa: E402

MATMULS = ("_paged_canvas_kernel", "_gemm_kernel", "_router_kernel")
EXPERTS = 128  # the released model's


@pytest.fixture(scope="module")
def reports(request):
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider: compile everything
    return cache.mkdir("triton_sm_reports") if cache is not None else None


@pytest.fixture(scope="module")
def variants(tmp_path_factory, reports):
    return released_variants(tmp_path_factory.mktemp("triton_cache"), reports)


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


def test_at_batch_1_each_expert_and_linear_is_one_row_tile(variants):
    """A batch-1 decoder step (one 256-position canvas) of every weight format: an expert GEMM's grid
    has one program column per expert (it walks its own rows, decoding each weight tile once a row
    tile), a quantised linear's one row tile (BLOCK_M 256)."""
    for scheme, fmt in ((0, "int4"), (3, "nvfp4"), (2, "fp8")):
        label = f"step {fmt} batch 1"
        launches = [
            (v, g)
            for v in of(variants, "_gemm_kernel")
            if v["constexprs"]["SCHEME"] == scheme
            for g in v["grids"].get(label, [])
        ]
        grouped = [g for v, g in launches if v["constexprs"]["GROUPED"]]
        plain = [g for v, g in launches if not v["constexprs"]["GROUPED"]]
        assert grouped and plain, label
        assert all(g[0] == EXPERTS for g in grouped), grouped
        assert all(g[0] == 1 for g in plain), plain


@pytest.fixture(scope="module")
def sm80_fp8(tmp_path_factory, reports):
    return released_variants(
        tmp_path_factory.mktemp("triton_cache_sm80"), reports, arch=80, only="_gemm_kernel:SCHEME=2"
    )


def test_the_fp8_gemm_streams_its_weights_on_ampere_too(sm80_fp8):
    """FP8 weights on an A100 (no FP8 tensor cores): the same kernel, compiled for sm80, holds to
    the 4-bit GEMMs' rules (vector loads, each byte once, mma) and neither spills nor overflows."""
    assert sm80_fp8 and all(v["arch"] == 80 for v in sm80_fp8)
    bad = [v for v in sm80_fp8 if streams(v) or v["spill_stores"] or v["shared"] > 164 * 1024]
    assert not bad, "\n".join(f"{streams(v)}: " + table([v]) for v in bad)
