"""The encoder pass's paged causal attention (`triton_attention._paged_prefix_kernel`) compiled
for sm90 (H100 / H200) and sm80 (A100) without a GPU, at every variant the released model's
launches pick (tests/kernels/triton_compile.py's driver: the encode of a committed block, prompt
chunks, an encode with an image): the sliding layers' D = 256 (64 x 32 tiles, 8 warps, 3 stages)
and the global layers' D = 512 (32 x 32, 8 warps, 2 stages), each with and without the image mask
(D = 256 then takes 32 query rows a tile on 4 warps: 64 rows spill registers on sm80).

Held to test_triton_compile.py's budgets: no register spills, shared memory within a block's
227 KiB on Hopper (164 KiB on an A100), registers that let a block launch, tensor-core MMA. One
subprocess an architecture, its reports cached under pytest's cache by triton's own key. Skipped,
saying why, where triton lacks the ahead-of-time API."""

import pytest

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
pytestmark = [pytest.mark.triton, pytest.mark.subprocess, pytest.mark.slow]

from triton_compile import HOPPER_SHARED, REGISTERS_PER_SM, released_variants, table  # noqa: E402

KERNEL = "_paged_prefix_kernel"
AMPERE_SHARED = 164 * 1024  # bytes of shared memory one block may use on an A100


@pytest.fixture(scope="module")
def reports(request):
    cache = getattr(request.config, "cache", None)
    return cache.mkdir("triton_sm_reports") if cache is not None else None


@pytest.mark.parametrize("arch,shared", [(90, HOPPER_SHARED), (80, AMPERE_SHARED)], ids=["sm90", "sm80"])
def test_the_prefix_attention_compiles_within_the_budgets(tmp_path, reports, arch, shared):
    variants = released_variants(tmp_path, reports, arch=arch, only=KERNEL)
    print("\n" + table(variants))
    assert all(v["kernel"] == KERNEL and v["arch"] == arch for v in variants)
    names = ("D", "SLIDING", "GROUPS", "BLOCK_M", "BLOCK_N")
    picked = {tuple(v["constexprs"][k] for k in names) + (v["num_warps"], v["num_stages"]) for v in variants}
    tiles = {
        (256, False): (True, 64, 32, 8, 3),
        (512, False): (False, 32, 32, 8, 2),
        (256, True): (True, 32, 32, 4, 3),  # with an image: 64 rows spill on sm80
        (512, True): (False, 32, 32, 8, 2),
    }
    expected = {(d, s, g, m, n, w, st) for (d, g), (s, m, n, w, st) in tiles.items()}
    assert picked == expected, picked
    bad = [
        v
        for v in variants
        if v["spill_stores"]
        or v["spill_loads"]
        or v["shared"] > shared
        or v["registers"] > 255
        or v["registers"] * 32 * v["num_warps"] > REGISTERS_PER_SM
        or not v["tensor_cores"]
    ]
    assert not bad, "spills, shared memory, registers or no tensor cores:\n" + table(bad)
