"""Every Triton kernel variant the released model's shapes launch (google/diffusiongemma-26B-A4B-it,
presets.PRESETS["real"], bf16) compiles for sm90 (H100 / H200) without a GPU: no register spills,
shared memory within a Hopper block's 227 KiB, registers that let a block launch, tensor-core
instructions in the matmuls.

The Triton interpreter runs Python, so it accepts kernels the GPU compiler refuses or compiles
badly; these compile to a cubin with triton's bundled ptxas instead (tests/kernels/triton_compile.py):
the launches are captured from the kernels' own wrappers, called as the engine calls them on
meta tensors, so the block sizes, warps, stages and split counts compiled are the ones the
picking functions choose (a change of picks is compiled here). One subprocess compiles every
variant (without TRITON_INTERPRET, which conftest sets for this process); each compile's report
is kept in pytest's cache under triton's own cache key, so a rerun compiles only what changed.
Skipped where triton lacks the ahead-of-time compile API."""

import pytest

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
# every test reads the one compile of all variants (a subprocess, ~45 s): the whole file is slow
pytestmark = [pytest.mark.triton, pytest.mark.subprocess, pytest.mark.slow]

from triton_compile import HOPPER_SHARED, REGISTERS_PER_SM, released_variants, table  # noqa: E402

from dgemma.kernels import triton_attention, triton_layer, triton_quant, triton_step  # noqa: E402

MATMULS = ("_paged_canvas_kernel", "_quant_matmul_kernel")


@pytest.fixture(scope="module")
def variants(tmp_path_factory, request):
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider: compile everything
    reports = cache.mkdir("triton_sm90_reports") if cache is not None else None
    return released_variants(tmp_path_factory.mktemp("triton_cache"), reports)


def of(variants, kernel):
    return [v for v in variants if v["kernel"] == kernel]


def test_every_kernel_is_compiled_at_the_picked_variants(variants):
    print("\n" + table(variants, uses=False))  # pytest -s: the table
    modules = (triton_step, triton_layer, triton_attention, triton_quant)
    assert {v["kernel"] for v in variants} == {n for m in modules for n in dir(m) if n.endswith("_kernel")}

    assert {v["constexprs"]["HAS_MASK"] for v in of(variants, "_stats_kernel") + of(variants, "_weights_kernel")} == {False, True}
    norm = {(v["constexprs"]["HALF"], v["constexprs"]["HAS_WEIGHT"], v["constexprs"]["HAS_ROPE"]) for v in of(variants, "_norm_rope_kernel")}
    assert norm == {(half, w, w) for half in (128, 256) for w in (True, False)}  # q / k normed and rotated, v normed

    # attention: both head dims, every split count pick_splits gives on an H200 (one canvas: the most)
    splits = {}
    for v in of(variants, "_paged_canvas_kernel"):
        splits.setdefault(v["constexprs"]["D"], set()).add(v["constexprs"]["NUM_SPLITS"])
    assert set(splits) == {256, 512}
    for d, counts in splits.items():
        assert counts == set(range(1, max(counts) + 1)) and max(counts) > 1, (d, counts)
    combined = {(v["constexprs"]["D"], v["constexprs"]["NUM_SPLITS"]) for v in of(variants, "_combine_splits_kernel")}
    assert combined == {(d, s) for d, counts in splits.items() for s in counts if s > 1}

    # quantised matmuls: every scheme, plain and grouped, at every block size _pick_blocks picks
    picks = {triton_quant._pick_blocks(rows, 2816) for rows in (1, 16, 32, 64, 128, 4096)}
    for scheme in triton_quant.SCHEME_IDS.values():
        for grouped in (False, True):
            blocks = {
                (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"])
                for c in (v["constexprs"] for v in of(variants, "_quant_matmul_kernel"))
                if c["SCHEME"] == scheme and c["GROUPED"] == grouped
            }
            assert blocks == picks, (scheme, grouped)


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
