"""The engine's Triton decoder step in bf16 (the fused network of kernels/fused.py: every kernel of
a layer, run on CPU by Triton's interpreter) against the float32 reference (the torch modules in
float32): the shipped dgemma-tiny, prompts and canvases of real Python source (its training
domain, so positions have confident predictions), prompts encoded through the same paths.

A bf16 pass differs from float32 by rounding alone, so the logits agree within 1% (relative L2)
and the argmax of nearly every position (at least 99%); bf16 rounding in the wrong place (a norm
rounded once where torch rounds twice is fine; a weight read as the wrong tensor is not) shows
far beyond that. The torch path's own bf16 step is measured beside it, as the yardstick."""

import inspect
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
pytestmark = [pytest.mark.triton, pytest.mark.slow]

import dgemma  # noqa: E402
from dgemma.engine.engine import Engine, EngineOptions  # noqa: E402
from dgemma.kernels import triton_canvas  # noqa: E402

if not triton_canvas.INTERPRETED:
    pytest.skip("triton was imported before TRITON_INTERPRET was set: the kernels need a GPU", allow_module_level=True)

CANVASES = 4


def source_windows(model, prompt: int, canvas: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, continuation) token windows of real Python source (the standard library's)."""
    text = "".join(inspect.getsource(m) for m in (inspect, os))
    ids = model.tokenizer.encode(text)
    step = len(ids) // (CANVASES + 1)
    return [
        (ids[i * step : i * step + prompt], ids[i * step + prompt : i * step + prompt + canvas])
        for i in range(CANVASES)
    ]


def decoder_logits(net, triton: bool, windows) -> torch.Tensor:
    """Float32 logits [n C, V] of one decoder pass over the continuations after their prompts,
    through an engine's network and cache (Triton: the fused network and the paged attention)."""
    engine = Engine(
        net,
        EngineOptions(
            triton=triton, cuda_graphs=False, batch_invariant=False, prefix_cache=False, kv_cache_memory=2**26
        ),
    )
    runner, c = engine.runner, net.config.canvas_length
    rows = [engine.encode_prefix(p) for p, _ in windows]
    canvas = torch.tensor([cont for _, cont in windows])
    plan = runner.cache.plan_canvas(c, rows) if triton else runner.cache.plan_decoder(c, rows)
    with torch.no_grad():
        return net.logits(runner.net.decode(canvas, plan, None)).float().reshape(-1, net.config.vocab_size)


def test_the_triton_bf16_step_is_the_float32_reference_within_rounding():
    ref_model = dgemma.load(dtype="float32")
    c = ref_model.config.canvas_length
    windows = source_windows(ref_model, 48, c)
    want = decoder_logits(ref_model.net, False, windows)
    net16 = dgemma.load(dtype="bfloat16").net
    got = decoder_logits(net16, True, windows)
    torch_bf16 = decoder_logits(net16, False, windows)

    def measure(logits):
        rel = float((logits - want).norm() / want.norm())
        agree = float((logits.argmax(-1) == want.argmax(-1)).float().mean())
        return rel, agree

    (rel, agree), (torch_rel, torch_agree) = measure(got), measure(torch_bf16)
    print(f"\nTriton bf16: relative L2 {rel:.2e}, argmax {agree:.1%}; torch bf16: {torch_rel:.2e}, {torch_agree:.1%}")
    assert rel <= 1e-2 and agree >= 0.99
    assert rel <= 2 * torch_rel  # no worse than torch's own bf16 chain, to within its noise
