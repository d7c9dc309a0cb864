"""The fused GPU layer's adapter kernels (kernels/triton_lora.py) against torch, in Triton's
interpreter: rows on several adapter slots and none, one to three linears side by side."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
pytestmark = pytest.mark.triton

import torch  # noqa: E402

from dgemma.kernels import triton_lora  # noqa: E402


def reference(x, out, a, b, slots):
    """`add_lora` in torch (float32, a row at a time)."""
    result = out.float().clone()
    start = 0
    for ap, bp in zip(a, b):
        width = bp.shape[1]
        for i, s in enumerate(slots.tolist()):
            if s >= 0:
                result[i, start : start + width] += (x[i].float() @ ap[s].float().t()) @ bp[s].float().t()
        start += width
    return result.to(out.dtype)


def inputs(widths, dtype, rank=8, slots=3, k=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # rows of a request are consecutive: runs on slot 0, none, 2, a block that mixes, 1
    row_slots = [0] * 40 + [-1] * 17 + [2] * 30 + [1, -1, 2, 0] * 3 + [1] * 9
    m = len(row_slots)
    x = torch.randn(m, k, generator=gen).to(dtype)
    out = torch.randn(m, sum(widths), generator=gen).to(dtype)
    a = [(torch.randn(slots, rank, k, generator=gen) * 0.1).to(dtype) for _ in widths]
    b = [(torch.randn(slots, n, rank, generator=gen) * 0.1).to(dtype) for n in widths]
    return x, out, a, b, torch.tensor(row_slots, dtype=torch.int32)


@pytest.mark.parametrize("widths", [(64,), (64, 32), (64, 32, 32), (40, 24, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shrink_and_expand_match_torch(widths, dtype):
    x, out, a, b, slots = inputs(widths, dtype)
    expected = reference(x, out, a, b, slots)
    got = triton_lora.add_lora(x, out.clone(), a, b, slots)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    untouched = slots < 0
    assert torch.equal(got[untouched], out[untouched])  # rows without an adapter keep the GEMM's output


def test_a_rank_below_the_padding_reads_zeros_beyond_it():
    x, out, a, b, slots = inputs((48,), torch.float32, rank=5)
    assert triton_lora.padded_rank(5) == 16
    got = triton_lora.add_lora(x, out.clone(), a, b, slots)
    assert torch.allclose(got, reference(x, out, a, b, slots), atol=1e-5)


def test_no_row_on_an_adapter_changes_nothing():
    x, out, a, b, _ = inputs((32, 32), torch.float32)
    none = torch.full((x.shape[0],), -1, dtype=torch.int32)
    assert torch.equal(triton_lora.add_lora(x, out.clone(), a, b, none), out)
